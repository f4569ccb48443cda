"""POST /tokenize and POST /detokenize, as vLLM serves them.

The server's own tokenizer and chat template answer, so a client counts a prompt's tokens
exactly as generation will (chat messages render through the template first).
"""

from __future__ import annotations

from aiohttp import web

from common.protocol import Ready
from frontend.body_reader import BodyReader, parse_json_object
from frontend.errors import invalid_param
from frontend.schemas import parse_messages
from frontend.state import STATE, ServerState


async def _read(request: web.Request) -> tuple[ServerState, Ready, BodyReader]:
    state = request.app[STATE]
    reader = BodyReader(parse_json_object(await request.read()))
    _, info = state.ready_engine()
    state.check_model(reader.string("model"))
    return state, info, reader


async def tokenize(request: web.Request) -> web.Response:
    state, info, reader = await _read(request)
    has_prompt, has_messages = reader.present("prompt"), reader.present("messages")
    if has_prompt == has_messages:
        raise invalid_param("prompt", "Send exactly one of 'prompt' and 'messages'.",
                            code=None if has_prompt else "missing_required_parameter")
    if has_messages:
        messages = parse_messages(reader.body["messages"])
        tokens = await state.tokenizer.encode_chat(
            messages, reader.boolean("add_generation_prompt", True))
    else:
        prompt = reader.string("prompt")
        assert prompt is not None
        tokens = await state.tokenizer.encode_prompt(
            prompt, reader.boolean("add_special_tokens", True))
    return web.json_response(
        {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    state, info, reader = await _read(request)
    if not reader.present("tokens"):
        raise invalid_param("tokens", "'tokens' is required.", code="missing_required_parameter")
    tokens = reader.token_id_list("tokens", info.vocab_size)
    return web.json_response({"prompt": await state.tokenizer.decode(tokens)})
