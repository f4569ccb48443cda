"""Graceful shutdown: refuse new API requests with 503, let the open ones finish.

The listening socket stays open while draining, so a client that arrives late gets a
clear 503 instead of a refused connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from frontend.errors import shutting_down


@dataclass(slots=True)
class Drain:
    draining: bool = False
    in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    def start(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every open API request finished within timeout_s."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def middleware(self) -> web.middleware:
        @web.middleware
        async def track(request: web.Request, handler) -> web.StreamResponse:
            if not request.path.startswith("/v1/") or request.method != "POST":
                return await handler(request)
            if self.draining:
                raise shutting_down()
            self.in_flight += 1
            self._idle.clear()
            try:
                return await handler(request)
            finally:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self._idle.set()

        return track
