"""POST /v1/embeddings for the served (decoder) model, as vLLM serves one with a pooler: each
input's prompt runs as a prefill-only engine request through the same scheduler as every
other, and comes back as its final hidden states pooled (`--pooling-type`: the last token's
or the mean) and L2-normalized (engine.pooling).

`input`: a string, a list of strings, token ids or a list of token-id lists;
`encoding_format`: "float" (default) or "base64" (little-endian float32, as OpenAI's);
`dimensions` is refused: a decoder's states cannot be shortened meaningfully."""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from frontend.body_reader import BodyReader, parse_json_object
from frontend.context_limit import ContextLimit
from frontend.errors import APIError, invalid_param
from frontend.openai_api import collect_all, engine_failure, prepare_generations
from frontend.prompt_input import parse_prompts
from frontend.request_policy import policy_of
from frontend.request_stream import EngineBusyError, EngineRequestError, EngineUnavailableError
from frontend.schemas import GenerationOptions
from frontend.state import STATE

ENCODINGS = ("float", "base64")
MAX_INPUTS = 2048  # OpenAI's limit per request


async def create_embedding(request: web.Request) -> web.Response:
    arrival = time.monotonic()
    state = request.app[STATE]
    body = parse_json_object(await request.read())
    _, info = state.ready_engine()
    reader = BodyReader(body)
    model = reader.string("model")
    state.check_model(model)
    encoding = reader.string("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise invalid_param("encoding_format", f"'encoding_format' must be one of "
                                               f"{list(ENCODINGS)}, got {encoding!r}.")
    if body.get("dimensions") is not None:
        raise invalid_param("dimensions", f"Model {state.model_name} does not support "
                                          "'dimensions' (matryoshka) embeddings.")
    inputs = parse_prompts(body.get("input"), info.vocab_size, "input")
    if len(inputs) > MAX_INPUTS:
        raise invalid_param("input", f"At most {MAX_INPUTS} inputs per request, got "
                                     f"{len(inputs)}.")
    if any(item == "" for item in inputs):
        raise invalid_param("input", "'input' must not contain empty strings.")
    prompts = [await state.tokenizer.encode_prompt(item) if isinstance(item, str) else item
               for item in inputs]
    most = ContextLimit.of(info).tokens - 1  # the pooled prompt's one sampled token
    for index, prompt in enumerate(prompts):
        if len(prompt) > most:
            raise APIError(f"Input {index} has {len(prompt)} tokens; this model embeds at "
                           f"most {most}.", param="input", code="context_length_exceeded")
    options = GenerationOptions(model=model, max_tokens=1, sampling_fields={
        "temperature": 0.0, "pooling": state.settings.pooling_type})
    generations = prepare_generations(state, prompts, options, f"embd-{uuid.uuid4().hex}",
                                      "input", arrival, policy_of(request))
    try:
        async with contextlib.AsyncExitStack() as running:
            for generation in generations:
                await running.enter_async_context(generation)
            await collect_all(generations)
    except (EngineUnavailableError, EngineBusyError, EngineRequestError) as exc:
        raise engine_failure(exc) from exc
    data = []
    for index, generation in enumerate(generations):
        if generation.embedding is None:
            raise engine_failure(EngineRequestError(
                f"the engine finished input {index} without its embedding"))
        data.append({"object": "embedding", "index": index,
                     "embedding": _encoded(generation.embedding, encoding)})
    tokens = sum(len(prompt) for prompt in prompts)
    return web.json_response({"object": "list", "data": data, "model": state.model_name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector: bytes, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector).decode()
    return np.frombuffer(vector, "<f4").tolist()
