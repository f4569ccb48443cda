"""A stand-in OpenAI-compatible server that streams canned answers instantly.

Every streaming request gets `max_tokens` chunks of one token each (TOKEN_TEXT re-encodes
to exactly one SmolLM2 token per repetition), then a usage chunk when asked, then [DONE].
With `metrics`, it also serves a Loom-style `/metrics` whose `loom:step_time_seconds`
histogram gains one 4 ms observation per token sent. It measures the load generator,
not a model:

    python -m tests.canned_server --port 8100 [--interval-ms 1] &
    python -m bench.serve --base-url http://127.0.0.1:8100 --endpoint /v1/chat/completions \
        --tokenizer ~/.cache/loom/SmolLM2-135M-Instruct --dataset random --input-len 32 \
        --num-prompts 256 --output-len 256 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

TOKEN_TEXT = " the"
MODEL_NAME = "canned"
DEFAULT_MAX_TOKENS = 16


@dataclass(slots=True)
class CannedSettings:
    fail_every: int = 0  # > 0: every n-th completion request is answered 500
    max_tokens_cap: int = 4096
    metrics: bool = False
    interval_s: float = 0.0  # > 0: a pause between token chunks, so streams interleave


@dataclass(slots=True)
class CannedCounters:
    requests: int = 0
    tokens_sent: int = 0


SETTINGS = web.AppKey("settings", CannedSettings)
COUNTERS = web.AppKey("counters", CannedCounters)


def create_app(settings: CannedSettings | None = None) -> web.Application:
    app = web.Application()
    app[SETTINGS] = settings or CannedSettings()
    app[COUNTERS] = CannedCounters()
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    if app[SETTINGS].metrics:
        app.router.add_get("/metrics", _metrics)
    return app


async def _metrics(request: web.Request) -> web.Response:
    counters = request.app[COUNTERS]
    steps = counters.tokens_sent
    text = (
        "# TYPE loom:requests_total counter\n"
        f"loom:requests_total {counters.requests}\n"
        "# TYPE loom:step_time_seconds histogram\n"
        'loom:step_time_seconds_bucket{le="0.001"} 0\n'
        f'loom:step_time_seconds_bucket{{le="0.005"}} {steps}\n'
        f'loom:step_time_seconds_bucket{{le="+Inf"}} {steps}\n'
        f"loom:step_time_seconds_sum {steps * 0.004}\n"
        f"loom:step_time_seconds_count {steps}\n"
    )
    return web.Response(text=text, content_type="text/plain")


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})


async def _completions(request: web.Request) -> web.StreamResponse:
    settings, counters = request.app[SETTINGS], request.app[COUNTERS]
    counters.requests += 1
    if settings.fail_every and counters.requests % settings.fail_every == 0:
        return web.json_response({"error": {"message": "canned failure", "type": "server_error",
                                            "param": None, "code": None}}, status=500)
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    num_tokens = min(int(body.get("max_tokens") or DEFAULT_MAX_TOKENS), settings.max_tokens_cap)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if chat:
        await response.write(_event(_chunk(chat, {"role": "assistant", "content": ""}, None)))
    token_event = _event(_chunk(chat, TOKEN_TEXT, None))
    for _ in range(num_tokens - 1):
        await response.write(token_event)
        if settings.interval_s:
            await asyncio.sleep(settings.interval_s)
    await response.write(_event(_chunk(chat, TOKEN_TEXT, "length")))
    counters.tokens_sent += num_tokens
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 1, "completion_tokens": num_tokens,
                 "total_tokens": 1 + num_tokens}
        await response.write(_event(_chunk(chat, None, None) | {"choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _chunk(chat: bool, content: str | dict | None, finish_reason: str | None) -> dict[str, Any]:
    if chat:
        delta = content if isinstance(content, dict) else {"content": content}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": content, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": "canned", "object": kind, "created": 0, "model": MODEL_NAME,
            "choices": [choice]}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@asynccontextmanager
async def running(settings: CannedSettings | None = None
                  ) -> AsyncIterator[tuple[str, web.Application]]:
    """The server on a free 127.0.0.1 port in this event loop: (base URL, app)."""
    app = create_app(settings)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.canned_server")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--interval-ms", type=float, default=0.0,
                        help="pause between token chunks (default: none)")
    args = parser.parse_args()
    settings = CannedSettings(fail_every=args.fail_every, metrics=args.metrics,
                              interval_s=args.interval_ms / 1000)
    web.run_app(create_app(settings), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
