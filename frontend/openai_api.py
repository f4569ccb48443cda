"""Handlers for POST /v1/completions and POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from frontend.body_reader import parse_json_object
from frontend.choices import choice_requests, total_usage
from frontend.context_limit import ContextLimit
from frontend.deadline_admission import PendingPrompt
from frontend.errors import APIError, engine_unavailable, invalid_param, shutting_down
from frontend.generation import Delta, Generation, GenerationHooks
from frontend.logprobs_format import ChatLogprobs, CompletionLogprobs
from frontend.request_policy import RequestPolicy, deadline_exceeded, policy_of
from frontend.request_stream import (
    DeadlineExceededError,
    EngineBusyError,
    EngineRequestError,
    EngineUnavailableError,
    ShuttingDownError,
)
from frontend.responses import ChatFormat, CompletionFormat, ResponseFormat
from frontend.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerationOptions,
    parse_chat_request,
    parse_completion_request,
)
from frontend.sse import EventStream
from frontend.state import STATE, ServerState
from frontend.stream_merge import merge
from frontend.structured_outputs import build_grammars

logger = logging.getLogger("loom.frontend.api")
Parsed = TypeVar("Parsed", CompletionRequest, ChatRequest)


async def _read_request(request: web.Request, parse: Callable[[dict[str, Any], int], Parsed]
                        ) -> tuple[ServerState, Parsed]:
    """The body parsed and validated, once the engine is known ready and the model matches."""
    state = request.app[STATE]
    body = parse_json_object(await request.read())
    _, info = state.ready_engine()
    parsed = parse(body, info.vocab_size)
    state.check_model(parsed.options.model)
    await build_request_grammars(parsed.options)
    return state, parsed


async def build_request_grammars(options: GenerationOptions) -> None:
    """The grammars of the output's constraint, if any, built on a thread (a large one takes
    a second) into the sampling fields."""
    if options.structured is not None:
        options.sampling_fields["grammars"] = await asyncio.to_thread(
            build_grammars, options.structured)


async def chat_prompt(state: ServerState, parsed: Any) -> tuple[list[int], str | None]:
    """A chat-shaped request's prompt ids and the tool parser to read its reply with, when
    the reply may call tools. `parsed` has `messages` and `tools`, as ChatRequest has (the
    Messages and Responses APIs' requests too)."""
    prompt_ids = await state.tokenizer.encode_chat(parsed.messages, tools=parsed.tools)
    calls = parsed.tools is not None and parsed.tools.parses_calls
    return prompt_ids, state.settings.tool_call_parser if calls else None


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state, parsed = await _read_request(request, parse_completion_request)
    options = parsed.options
    prompts = [
        await state.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        for prompt in parsed.prompts
    ]
    echo = None
    if parsed.echo:
        texts = [
            prompt if isinstance(prompt, str) else await state.tokenizer.decode(prompt)
            for prompt in parsed.prompts
        ]
        echo = [text for text in texts for _ in range(options.n)]
    response_format = CompletionFormat(
        f"cmpl-{uuid.uuid4().hex}",
        state.model_name,
        int(time.time()),
        options.include_usage,
        logprobs=(
            None if options.logprobs is None else CompletionLogprobs(state.tokenizer.token_texts)
        ),
        echo=echo,
    )
    return await _generate(request, state, prompts, options, response_format, arrival)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    parser = request.app[STATE].settings.tool_call_parser
    state, parsed = await _read_request(
        request, functools.partial(parse_chat_request, tool_call_parser=parser))
    options = parsed.options
    prompt_ids, tool_parser = await chat_prompt(state, parsed)
    response_format = ChatFormat(
        f"chatcmpl-{uuid.uuid4().hex}",
        state.model_name,
        int(time.time()),
        options.include_usage,
        logprobs=None if options.logprobs is None else ChatLogprobs(state.tokenizer.token_texts),
        tool_parser=tool_parser,
    )
    return await _generate(request, state, [prompt_ids], options, response_format, arrival)


async def _generate(
    request: web.Request,
    state: ServerState,
    prompts: list[list[int]],
    options: GenerationOptions,
    response_format: ResponseFormat,
    arrival: float,
) -> web.StreamResponse:
    prompt_param = "messages" if isinstance(response_format, ChatFormat) else "prompt"
    generations = prepare_generations(state, prompts, options, response_format.request_id,
                                      prompt_param, arrival, policy_of(request))
    try:
        async with contextlib.AsyncExitStack() as running:
            for generation in generations:
                await running.enter_async_context(generation)
            if options.stream:
                return await _stream(request, generations, options.n, response_format)
            results = await collect_all(generations)
    except (EngineUnavailableError, EngineBusyError, EngineRequestError) as exc:
        raise engine_failure(exc) from exc
    for generation, result in zip(generations, results, strict=True):
        log_finished(generation, result.native_finish_reason or result.finish_reason)
    usage = total_usage([generation.usage for generation in generations], options.n)
    return web.json_response(response_format.body(results, usage))


def prepare_generations(state: ServerState, prompts: list[list[int]],
                        options: GenerationOptions, request_id: str, prompt_param: str,
                        arrival: float, policy: RequestPolicy | None = None,
                        ) -> list[Generation]:
    """One Generation per choice, routed to one engine and admitted: enter them (`async
    with`) before the next await, so that the admission estimate cannot go stale. `policy`:
    the request's tenant (its prompt tokens are taken from its budget here) and deadline."""
    policy = policy or RequestPolicy()
    engines, info = state.ready_engine()
    if options.priority != 0 and not info.priority_scheduling:
        raise invalid_param("priority", "Request priorities need a server started with "
                            "--scheduling-policy priority.")
    limit = ContextLimit.of(info)
    sampling = []
    for prompt_ids in prompts:
        if not prompt_ids:
            raise invalid_param(prompt_param, "The prompt is empty after tokenization.")
        max_tokens = limit.max_tokens_for(len(prompt_ids), options.max_tokens, prompt_param)
        sampling.append(options.sampling_params(max_tokens))
    timeout_s = policy.remaining_s()
    engine_requests = choice_requests(request_id, prompts, sampling, options.n, time.time(),
                                      options.priority, policy.tenant_name,
                                      policy.tenant_weight, timeout_s)
    try:
        engine = engines.route(prompts)  # every prompt and choice of a request on one engine
    except EngineUnavailableError as exc:
        raise engine_failure(exc) from exc
    queue = state.queue_estimate
    hooks = GenerationHooks(queue.sent, queue.started, policy.generated)
    generations = [
        Generation(engine, state.tokenizer.tokenizer, engine_request, options.stop,
                   info.eos_token_ids, arrival, hooks)
        for engine_request in engine_requests
    ]  # fmt: skip
    state.admission.admit(engines, len(engine_requests), policy.within_share)
    num_prompt_tokens = sum(map(len, prompts))
    if state.settings.admission_control:
        queue.check(PendingPrompt(policy.tenant_name, policy.tenant_weight, num_prompt_tokens),
                    timeout_s)
    policy.take_prompt_tokens(num_prompt_tokens)
    return generations


async def collect_all(generations: list[Generation]) -> list[Delta]:
    tasks = [asyncio.create_task(generation.collect()) for generation in generations]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # the others, when one failed
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _stream(
    request: web.Request,
    generations: list[Generation],
    n: int,
    response_format: ResponseFormat,
) -> web.StreamResponse:
    events = EventStream(request)
    await events.open()
    finish_reasons: dict[int, str | None] = {}  # per choice that has sent a chunk
    try:
        try:
            deltas = merge([generation.deltas() for generation in generations])
            async with contextlib.aclosing(deltas):
                async for index, delta in deltas:
                    first = index not in finish_reasons
                    chunk = response_format.delta_chunk(index, delta, first)
                    if chunk is not None:
                        await events.send(chunk)
                        finish_reasons[index] = delta.finish_reason
            if response_format.include_usage:
                usage = total_usage([generation.usage for generation in generations], n)
                await events.send(response_format.usage_chunk(usage))
        except (EngineUnavailableError, EngineRequestError) as exc:
            logger.warning("%s failed mid-stream: %s", response_format.request_id, exc)
            await events.send(engine_failure(exc).body())
        await events.done()
    except ConnectionResetError:
        logger.info("%s: client disconnected", response_format.request_id)
        return events.response
    for index, generation in enumerate(generations):
        log_finished(generation, finish_reasons.get(index))
    return events.response


def engine_failure(exc: Exception) -> APIError:
    if isinstance(exc, DeadlineExceededError):
        return deadline_exceeded(f"The request's deadline passed: {exc}.")
    if isinstance(exc, EngineRequestError):
        return APIError(f"The engine refused the request: {exc}", code="request_refused")
    if isinstance(exc, ShuttingDownError):
        return shutting_down()
    return engine_unavailable(str(exc))


def log_finished(generation: Generation, finish_reason: str | None) -> None:
    usage = generation.usage
    logger.info(
        "%s finished (%s): %d prompt tokens (%d cached), %d generated",
        generation.request_id,
        finish_reason,
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
    )
