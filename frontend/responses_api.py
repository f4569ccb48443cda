"""Handlers for OpenAI's Responses API: POST /v1/responses, GET and DELETE
/v1/responses/{id}. The request becomes a chat completions body (frontend.responses_input)
that the chat path validates, renders and generates; the reply is shaped by
frontend.responses_output and, unless `store` is false, kept (frontend.response_store)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from frontend.body_reader import parse_json_object
from frontend.errors import APIError, invalid_param
from frontend.event_stream_reply import stream_reply
from frontend.openai_api import (
    build_request_grammars,
    chat_prompt,
    engine_failure,
    log_finished,
    prepare_generations,
)
from frontend.request_policy import policy_of
from frontend.request_stream import EngineBusyError, EngineRequestError, EngineUnavailableError
from frontend.response_store import ResponseStore, StoredResponse
from frontend.responses_input import chat_body
from frontend.responses_output import ResponseReply
from frontend.schemas import parse_chat_request
from frontend.state import STATE

STORE = web.AppKey("loom_response_store", ResponseStore)


async def create_response(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    body = parse_json_object(await request.read())
    _, info = state.ready_engine()
    store = request.app[STORE]
    keep = _flag(body, "store", True)
    if _flag(body, "background", False):
        raise invalid_param("background", "'background' responses are not supported.")
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise invalid_param("previous_response_id", "'previous_response_id' must be a "
                                                         "string.")
        history = [dict(message) for message in store.get(previous).conversation]
    chat, conversation = chat_body(body, history)
    parsed = parse_chat_request(chat, info.vocab_size,
                                tool_call_parser=state.settings.tool_call_parser)
    state.check_model(parsed.options.model)
    options = parsed.options
    await build_request_grammars(options)
    prompt_ids, tool_parser = await chat_prompt(state, parsed)
    reply = ResponseReply(body, state.model_name, tool_parser)
    [generation] = prepare_generations(state, [prompt_ids], options, reply.response_id,
                                       "input", arrival, policy_of(request))
    try:
        async with generation:
            if options.stream:
                response = await stream_reply(request, generation, reply, _error_event)
            else:
                result = await generation.collect()
                log_finished(generation, result.finish_reason)
                response = web.json_response(reply.finished(result, generation.usage))
    except (EngineUnavailableError, EngineBusyError, EngineRequestError) as exc:
        raise engine_failure(exc) from exc
    if keep and reply.status != "in_progress":  # whole, not cut off by a hang-up
        final = reply.response(reply.status, generation.usage)
        store.put(StoredResponse(final, [*conversation, reply.assistant_message()]))
    return response


def _error_event(error: APIError) -> tuple[str, dict]:
    return "error", {"type": "error", "code": error.code, "message": error.message,
                     "param": error.param}


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_param(name, f"'{name}' must be a boolean.")
    return value


async def get_response(request: web.Request) -> web.Response:
    stored = request.app[STORE].get(request.match_info["response_id"])
    return web.json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    request.app[STORE].delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})
