"""Request body size cap: 413 with the OpenAI error body, before reading when possible."""

from __future__ import annotations

from aiohttp import web

from frontend.errors import body_too_large

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def body_limit_middleware(max_bytes: int) -> web.middleware:
    @web.middleware
    async def limit_body(request: web.Request, handler) -> web.StreamResponse:
        size = request.content_length
        if size is not None and size > max_bytes:
            raise body_too_large(max_bytes, size)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge as exc:  # a chunked body that grew too big
            raise body_too_large(max_bytes, None) from exc

    return limit_body
