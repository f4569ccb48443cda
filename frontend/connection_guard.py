"""Every HTTP connection, watched from outside aiohttp: how many are open (a cap, 503
beyond it), how long one may sit idle between requests (--keep-alive-timeout), and how
long a request may take to arrive from its first byte (--request-read-timeout).

aiohttp has no read timeout of its own: a client that sends its headers, or its body, one
byte at a time holds a descriptor and a handler for as long as it likes. Each connection's
protocol is wrapped here, so the guard sees every byte arrive; the guard middleware tells
it when aiohttp hands a request to the app (its headers are in) and when the app is done
with it. The body's part of the deadline is kept by frontend.read_timeout.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from frontend.connection_limits import ConnectionLimits
from frontend.errors import APIError, request_timeout, too_many_connections
from frontend.metrics import LoomMetrics
from frontend.raw_reply import RefusedConnection, reply_and_close

# Refused connections still in their lingering close; beyond this many, refusals close at
# once, so a flood of them cannot run the process out of descriptors.
MAX_LINGERING_REFUSALS = 256


class Phase(enum.Enum):
    WAITING = "waiting"  # for the first byte of the next request
    RECEIVING = "receiving"  # a request's bytes are arriving; its headers are not all in
    HANDLING = "handling"  # the app has the request (the body may still be arriving)
    DRAINING = "draining"  # answered before its body was read: aiohttp drops the rest, closes
    CLOSING = "closing"  # answered by the guard, closing


@dataclass(slots=True)
class ConnectionGuard:
    limits: ConnectionLimits
    metrics: LoomMetrics
    open_connections: int = 0
    lingering_refusals: int = 0

    def protocol_factory(self, make_handler: Callable[[], asyncio.Protocol]
                         ) -> Callable[[], asyncio.Protocol]:
        def make_protocol() -> asyncio.Protocol:
            if self.open_connections >= self.limits.max_connections:
                return self._refusal()
            # Counted now, not when the connection is made: asyncio accepts a burst of
            # connections before it makes any of them.
            self.opened()
            return GuardedProtocol(self, make_handler())

        return make_protocol

    def _refusal(self) -> RefusedConnection:
        self.dropped("max_connections")
        linger_s = self.limits.linger_s
        if self.lingering_refusals >= MAX_LINGERING_REFUSALS:
            linger_s = 0.0
        self.lingering_refusals += 1
        return RefusedConnection(too_many_connections(self.limits.max_connections), linger_s,
                                 on_lost=self._refusal_lost)

    def _refusal_lost(self) -> None:
        self.lingering_refusals -= 1

    def opened(self) -> None:
        self.open_connections += 1
        self.metrics.connections_open.set(self.open_connections)

    def closed(self) -> None:
        self.open_connections -= 1
        self.metrics.connections_open.set(self.open_connections)

    def dropped(self, reason: str) -> None:
        """The server closes a connection of its own accord (a reason of the metric)."""
        self.metrics.connections_closed.labels(reason).inc()


@dataclass(eq=False, slots=True)
class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind a watch on its phase and clock."""

    guard: ConnectionGuard
    inner: asyncio.Protocol
    transport: asyncio.Transport | None = None
    phase: Phase = Phase.WAITING
    request_began_at: float | None = None  # loop time of the current request's first byte
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._wait_for_request()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.CLOSING:
            return
        if self.phase is Phase.WAITING:
            self.phase = Phase.RECEIVING
            self.request_began_at = self._loop.time()
            self._arm(self.guard.limits.request_read_timeout_s, self._headers_expired)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.phase is Phase.CLOSING:
            return False
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.phase = Phase.CLOSING
        self.transport = None
        self.guard.closed()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def request_started(self) -> None:
        """The app has the request: the header clock stops. (A request whose bytes came
        while the one before was handled counts from now.)"""
        self._disarm()
        if self.phase is not Phase.RECEIVING or self.request_began_at is None:
            self.request_began_at = self._loop.time()
        if self.phase is not Phase.CLOSING:
            self.phase = Phase.HANDLING

    def request_finished(self, body_read: bool) -> None:
        if self.phase is not Phase.HANDLING or self.transport is None:
            return
        if body_read:
            self._wait_for_request()
        else:  # what still comes is that body, not a next request: no clock of its own
            self.phase = Phase.DRAINING
            self._arm(self.guard.limits.keep_alive_timeout_s + self.guard.limits.linger_s,
                      self._drain_expired)

    def _drain_expired(self) -> None:
        self._timer = None
        if self.phase is Phase.DRAINING and self.transport is not None:
            self.phase = Phase.CLOSING
            self.transport.close()

    def _wait_for_request(self) -> None:
        self.phase = Phase.WAITING
        self.request_began_at = None
        self._arm(self.guard.limits.keep_alive_timeout_s, self._idle_expired)

    def _idle_expired(self) -> None:
        self._timer = None
        if self.phase is not Phase.WAITING or self.transport is None:
            return
        if self.transport.get_write_buffer_size() > 0:  # the last reply is still going out
            self._arm(self.guard.limits.keep_alive_timeout_s, self._idle_expired)
            return
        self._close("keep_alive_timeout", None)

    def _headers_expired(self) -> None:
        self._timer = None
        if self.phase is Phase.RECEIVING and self.transport is not None:
            self._close("read_timeout",
                        request_timeout("headers", self.guard.limits.request_read_timeout_s))

    def _close(self, reason: str, error: APIError | None) -> None:
        assert self.transport is not None
        self.phase = Phase.CLOSING
        self.guard.dropped(reason)
        reply_and_close(self.transport, error, self.guard.limits.linger_s)

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self._loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def guarded_protocol(request: web.Request) -> GuardedProtocol | None:
    """The guard's wrapper around this request's connection; None where the app is served
    without one (tests that run it on aiohttp's own site)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, GuardedProtocol) else None


@web.middleware
async def guard_middleware(request: web.Request, handler) -> web.StreamResponse:
    protocol = guarded_protocol(request)
    if protocol is None:
        return await handler(request)
    protocol.request_started()
    try:
        return await handler(request)
    finally:
        protocol.request_finished(body_read=request.content.at_eof())



class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite, each connection's protocol wrapped by the guard."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 backlog: int = 2048) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server), self._host, self._port,
            backlog=self._backlog)
