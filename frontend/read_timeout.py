"""The body's part of --request-read-timeout: the app reads a request's whole body before
any handler runs, and must have it within the timeout of the request's first byte, or the
client gets a 408 and its connection is closed. (aiohttp closes a connection whose body
was not read to the end, after reading and dropping what still comes for its lingering
time, so that the reply is not lost to a reset.)"""

from __future__ import annotations

import asyncio

from aiohttp import web

from frontend.connection_guard import guarded_protocol
from frontend.errors import request_timeout


def read_timeout_middleware(timeout_s: float) -> web.middleware:
    @web.middleware
    async def read_body_in_time(request: web.Request, handler) -> web.StreamResponse:
        if request.body_exists:
            protocol = guarded_protocol(request)
            began_at = protocol.request_began_at if protocol is not None else None
            if began_at is None:  # served without the guard
                began_at = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout_at(began_at + timeout_s):
                    await request.read()  # kept by the request: handlers read it again
            except TimeoutError:
                if protocol is not None:
                    protocol.guard.dropped("read_timeout")
                error = request_timeout("body", timeout_s)
                error.headers["Connection"] = "close"
                raise error from None
        return await handler(request)

    return read_body_in_time
