"""An error written straight onto a connection that aiohttp is not answering (over the
connection cap, or a request that never finished arriving), then a lingering close.

Closing a socket whose client is still sending makes the kernel reset it, and a reset can
destroy the reply before the client reads it. So the reply is followed by a half-close:
what the client still sends is read and dropped until it closes its side, or LINGER_S
passes.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

from frontend.errors import APIError

LINGER_S = 2.0


def http_bytes(error: APIError) -> bytes:
    body = json.dumps(error.body()).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
               "Connection": "close", **error.headers}
    head = f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode("latin-1") + body


def reply_and_close(transport: asyncio.Transport, error: APIError | None,
                    linger_s: float = LINGER_S) -> None:
    """The reply (none: close silently), a half-close, and the full close within linger_s;
    the connection's protocol must drop what arrives meanwhile and close on EOF."""
    if transport.is_closing():
        return
    if error is None or transport.get_write_buffer_size() > 0:  # a reply is being written
        transport.close()
        return
    transport.write(http_bytes(error))
    if linger_s <= 0 or not transport.can_write_eof():
        transport.close()
        return
    transport.write_eof()
    asyncio.get_running_loop().call_later(linger_s, transport.close)


class RefusedConnection(asyncio.Protocol):
    """A connection over the cap: it gets `error` at once and is closed."""

    def __init__(self, error: APIError, linger_s: float, on_lost) -> None:
        self.error = error
        self.linger_s = linger_s
        self.on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        reply_and_close(transport, self.error, self.linger_s)

    def data_received(self, data: bytes) -> None:
        pass  # the request it sends is not read

    def eof_received(self) -> bool:
        return False  # the client is done: close now

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost()
