"""Handlers for POST /v1/completions and POST /v1/chat/completions."""

from __future__ import annotations

import logging
import time
import uuid

from aiohttp import web

from common.protocol import AddRequest
from frontend.body_reader import parse_json_object
from frontend.context_limit import ContextLimit
from frontend.engine_client import EngineBusyError, EngineDeadError, EngineRequestError
from frontend.errors import APIError, engine_unavailable, invalid_param
from frontend.generation import Generation
from frontend.responses import ChatFormat, CompletionFormat
from frontend.schemas import GenerationOptions, parse_chat_request, parse_completion_request
from frontend.sse import EventStream
from frontend.state import STATE, ServerState

logger = logging.getLogger("loom.frontend.api")


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_json_object(await request.read())
    _, info = state.ready_engine()
    parsed = parse_completion_request(body, info.vocab_size)
    state.check_model(parsed.options.model)
    if isinstance(parsed.prompt, str):
        prompt_ids = await state.tokenizer.encode_prompt(parsed.prompt)
    else:
        prompt_ids = parsed.prompt
    request_id = f"cmpl-{uuid.uuid4().hex}"
    response_format = CompletionFormat(
        request_id, state.model_name, int(time.time()), parsed.options.include_usage
    )
    return await _generate(request, state, prompt_ids, parsed.options, response_format)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_json_object(await request.read())
    _, info = state.ready_engine()
    parsed = parse_chat_request(body, info.vocab_size)
    state.check_model(parsed.options.model)
    prompt_ids = await state.tokenizer.encode_chat(parsed.messages)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    response_format = ChatFormat(
        request_id, state.model_name, int(time.time()), parsed.options.include_usage
    )
    return await _generate(request, state, prompt_ids, parsed.options, response_format)


async def _generate(
    request: web.Request,
    state: ServerState,
    prompt_ids: list[int],
    options: GenerationOptions,
    response_format: CompletionFormat | ChatFormat,
) -> web.StreamResponse:
    engine, info = state.ready_engine()
    if not prompt_ids:
        raise invalid_param("prompt", "The prompt is empty after tokenization.")
    prompt_param = "messages" if isinstance(response_format, ChatFormat) else "prompt"
    max_tokens = ContextLimit.of(info).max_tokens_for(
        len(prompt_ids), options.max_tokens, prompt_param
    )
    engine_request = AddRequest(
        response_format.request_id, prompt_ids, options.sampling_params(max_tokens), time.time()
    )
    generation = Generation(
        engine, state.tokenizer.tokenizer, engine_request, options.stop, info.eos_token_ids
    )
    try:
        async with generation:
            if options.stream:
                return await _stream(request, generation, response_format)
            result = await generation.collect()
    except (EngineDeadError, EngineBusyError, EngineRequestError) as exc:
        raise _engine_failure(exc) from exc
    _log_finished(generation, result.finish_reason)
    return web.json_response(response_format.body(result, generation.usage))


async def _stream(
    request: web.Request,
    generation: Generation,
    response_format: CompletionFormat | ChatFormat,
) -> web.StreamResponse:
    events = EventStream(request)
    await events.open()
    finish_reason = None
    try:
        try:
            for chunk in response_format.opening_chunks():
                await events.send(chunk)
            async for delta in generation.deltas():
                await events.send(response_format.delta_chunk(delta))
                finish_reason = delta.finish_reason
            if response_format.include_usage:
                await events.send(response_format.usage_chunk(generation.usage))
        except (EngineDeadError, EngineRequestError) as exc:
            logger.warning("%s failed mid-stream: %s", generation.request_id, exc)
            await events.send(_engine_failure(exc).body())
        await events.done()
    except ConnectionResetError:
        logger.info("%s: client disconnected", generation.request_id)
        return events.response
    _log_finished(generation, finish_reason)
    return events.response


def _engine_failure(exc: Exception) -> APIError:
    if isinstance(exc, EngineRequestError):
        return APIError(f"The engine refused the request: {exc}", code="request_refused")
    return engine_unavailable(str(exc))


def _log_finished(generation: Generation, finish_reason: str | None) -> None:
    usage = generation.usage
    logger.info(
        "%s finished (%s): %d prompt tokens (%d cached), %d generated",
        generation.request_id,
        finish_reason,
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
    )
