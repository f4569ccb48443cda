"""Server-sent events in the OpenAI framing (`data: {json}\\n\\n`, ended by `data: [DONE]`) or
in Anthropic's (`event: <type>\\ndata: {json}\\n\\n`, ended by closing the stream)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class EventStream:
    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, payload: dict[str, Any]) -> None:
        """Raises ConnectionResetError once the client is gone."""
        await self.response.write(encode_event(payload))

    async def send_named(self, event: str, payload: dict[str, Any]) -> None:
        """Raises ConnectionResetError once the client is gone."""
        await self.response.write(f"event: {event}\n".encode() + encode_event(payload))

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()

    async def close(self) -> None:
        await self.response.write_eof()
