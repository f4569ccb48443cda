"""The connection guard on a small app served the way the frontend serves its own
(GuardedSite, the guard and read-timeout middlewares), with short limits: raw sockets
that trickle headers or a body, sit idle, or pile up over the cap, and a slow reader of a
long stream that must not be cut."""

from __future__ import annotations

import asyncio
import json
import resource
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from frontend import connection_limits
from frontend.app import error_middleware
from frontend.connection_guard import (
    MAX_LINGERING_REFUSALS,
    ConnectionGuard,
    GuardedSite,
    guard_middleware,
)
from frontend.connection_limits import (
    RESERVED_DESCRIPTORS,
    ConnectionLimits,
    connection_cap,
    raise_descriptor_limit,
)
from frontend.errors import request_timeout
from frontend.metrics import LoomMetrics
from frontend.raw_reply import http_bytes
from frontend.read_timeout import read_timeout_middleware

READ_TIMEOUT_S = 0.6
KEEP_ALIVE_S = 0.6
STREAM_S = 3 * (READ_TIMEOUT_S + KEEP_ALIVE_S)  # a stream that outlasts both limits
SLACK_S = 1.5  # timers and a busy shared CPU
LINGER_S = 1.0  # longer than the read timeout: what comes while lingering is no request
HEAD = b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"


async def echo(request: web.Request) -> web.Response:
    return web.json_response({"received": len(await request.read())})


async def slow_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    deadline = time.monotonic() + STREAM_S
    while time.monotonic() < deadline:
        await response.write(b"data: tick\n\n")
        await asyncio.sleep(0.1)
    await response.write(b"data: [DONE]\n\n")
    return response


@dataclass
class Served:
    guard: ConnectionGuard
    metrics: LoomMetrics
    port: int

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    def closed(self, reason: str) -> float:
        return self.metrics.connections_closed.labels(reason)._value.get()


async def serve(max_connections: int = 64) -> AsyncIterator[Served]:
    metrics = LoomMetrics()
    guard = ConnectionGuard(ConnectionLimits(max_connections, KEEP_ALIVE_S, READ_TIMEOUT_S,
                                             linger_s=LINGER_S), metrics)
    app = web.Application(middlewares=[guard_middleware, error_middleware,
                                       read_timeout_middleware(READ_TIMEOUT_S)])
    app.router.add_post("/echo", echo)
    app.router.add_post("/v1/messages", echo)
    app.router.add_get("/stream", slow_stream)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1,
                           keepalive_timeout=60, lingering_time=LINGER_S)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield Served(guard, metrics, port)
    finally:
        await runner.cleanup()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async for running in serve():
        yield running


@pytest.fixture
async def capped() -> AsyncIterator[Served]:
    async for running in serve(max_connections=3):
        yield running


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    async with asyncio.timeout(timeout_s):
        return await reader.read()


def parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in
               (line.partition(":") for line in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body) if body else {}


async def trickle(writer: asyncio.StreamWriter, reader: asyncio.StreamReader,
                  pace_s: float, limit_s: float) -> bytes:
    """One byte every pace_s, on after the answer begins, until the server closes; returns
    all it sent."""
    answer = asyncio.ensure_future(read_until_closed(reader, limit_s))
    while not answer.done():
        try:
            writer.write(b"x")
            await writer.drain()
        except ConnectionError:
            pass  # closed on us: its answer is in the reader
        await asyncio.wait([answer], timeout=pace_s)
    return answer.result()


async def test_headers_that_trickle_get_a_408_and_the_connection_closed(served: Served):
    reader, writer = await served.connect()
    started = time.monotonic()
    writer.write(HEAD + b"X-Slow: ")
    raw = await trickle(writer, reader, 0.1, READ_TIMEOUT_S + SLACK_S)
    elapsed = time.monotonic() - started
    status, headers, body = parse(raw)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and "headers" in body["error"]["message"]
    assert READ_TIMEOUT_S - 0.05 <= elapsed < READ_TIMEOUT_S + SLACK_S
    assert served.closed("read_timeout") == 1
    writer.close()


async def test_a_body_that_trickles_gets_a_408_and_the_connection_closed(served: Served):
    reader, writer = await served.connect()
    started = time.monotonic()
    writer.write(HEAD + b"Content-Length: 1000\r\n\r\n{")
    raw = await trickle(writer, reader, 0.1, READ_TIMEOUT_S + LINGER_S + SLACK_S)
    assert time.monotonic() - started >= READ_TIMEOUT_S - 0.05
    status, headers, body = parse(raw)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and "body" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    writer.close()
    await wait_for(lambda: served.guard.open_connections == 0)
    assert served.closed("read_timeout") == 1


async def test_a_body_timeout_on_the_messages_route_is_in_anthropics_shape(served: Served):
    reader, writer = await served.connect()
    writer.write(HEAD.replace(b"/echo", b"/v1/messages") + b"Content-Length: 10\r\n\r\n{")
    status, _, body = parse(await read_until_closed(reader, READ_TIMEOUT_S + LINGER_S
                                                    + SLACK_S))
    assert status == 408 and body["type"] == "error"
    writer.close()


async def test_an_idle_connection_is_closed_silently_after_the_keep_alive_timeout(
        served: Served):
    reader, writer = await served.connect()
    started = time.monotonic()
    assert await read_until_closed(reader, KEEP_ALIVE_S + SLACK_S) == b""
    assert time.monotonic() - started >= KEEP_ALIVE_S - 0.05
    writer.close()
    await wait_for(lambda: served.closed("keep_alive_timeout") == 1)


async def test_a_keep_alive_connection_serves_requests_then_closes_when_idle(served: Served):
    reader, writer = await served.connect()
    for request in range(3):  # each request ends well inside the limits, whatever came before
        if request:
            await asyncio.sleep(KEEP_ALIVE_S / 2)
        writer.write(HEAD + b"Content-Length: 2\r\n\r\n{}")
        status_line = await reader.readline()
        assert b" 200 " in status_line
        await reader.readuntil(b'{"received": 2}')
    started = time.monotonic()
    assert await read_until_closed(reader, KEEP_ALIVE_S + SLACK_S) == b""
    assert time.monotonic() - started >= KEEP_ALIVE_S - 0.05
    writer.close()


async def test_a_slow_reader_of_a_long_stream_is_not_cut(served: Served):
    reader, writer = await served.connect()
    writer.write(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
    started = time.monotonic()
    received = b""
    async with asyncio.timeout(STREAM_S + 10):
        while b"[DONE]" not in received:
            chunk = await reader.read(16)  # a few bytes at a time, now and then
            assert chunk, f"cut after {time.monotonic() - started:.1f} s: {received[-200:]!r}"
            received += chunk
            await asyncio.sleep(0.02)
    assert time.monotonic() - started >= STREAM_S
    assert served.closed("read_timeout") == served.closed("keep_alive_timeout") == 0
    writer.close()


async def test_connections_over_the_cap_get_a_503_and_are_closed(capped: Served):
    held = [await capped.connect() for _ in range(3)]
    await wait_for(lambda: capped.guard.open_connections == 3)
    reader, writer = await capped.connect()
    started = time.monotonic()
    status, headers, body = parse(await read_until_closed(reader, SLACK_S))
    assert time.monotonic() - started < SLACK_S
    assert status == 503 and headers["retry-after"] == "1"
    assert body["error"]["code"] == "too_many_connections"
    assert capped.closed("max_connections") == 1
    writer.close()
    held[0][1].close()
    await wait_for(lambda: capped.guard.open_connections == 2)
    reader, writer = await capped.connect()
    writer.write(HEAD + b"Content-Length: 2\r\n\r\n{}")
    assert b" 200 " in await reader.readline()
    for _, held_writer in [*held[1:], (reader, writer)]:
        held_writer.close()


async def test_a_burst_of_connections_gets_no_more_than_the_cap(capped: Served):
    connections = await asyncio.gather(*(capped.connect() for _ in range(12)))

    async def refused(reader: asyncio.StreamReader) -> bool:
        return await read_until_closed(reader, KEEP_ALIVE_S + SLACK_S) != b""

    answers = await asyncio.gather(*(refused(reader) for reader, _ in connections))
    assert sum(answers) == 12 - 3
    for _, writer in connections:
        writer.close()


async def test_a_refusal_whose_client_sends_a_request_still_reads_its_503(capped: Served):
    held = [await capped.connect() for _ in range(3)]
    await wait_for(lambda: capped.guard.open_connections == 3)
    reader, writer = await capped.connect()
    writer.write(HEAD + b"Content-Length: 2\r\n\r\n{}")
    status, _, _ = parse(await read_until_closed(reader, SLACK_S))
    assert status == 503
    writer.close()
    await wait_for(lambda: capped.guard.lingering_refusals == 0)
    for _, held_writer in held:
        held_writer.close()


async def test_past_the_lingering_bound_refusals_close_at_once(capped: Served):
    held = [await capped.connect() for _ in range(3)]
    await wait_for(lambda: capped.guard.open_connections == 3)
    capped.guard.lingering_refusals = MAX_LINGERING_REFUSALS
    reader, writer = await capped.connect()
    writer.write(HEAD)  # no linger: its reply comes, then the close, while it still sends
    raw = await read_until_closed(reader, SLACK_S)
    assert raw.startswith(b"HTTP/1.1 503 ")
    await wait_for(lambda: capped.guard.lingering_refusals == MAX_LINGERING_REFUSALS)
    writer.close()
    for _, held_writer in held:
        held_writer.close()


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def test_the_raw_reply_is_a_whole_http_response() -> None:
    raw = http_bytes(request_timeout("headers", 2.5))
    status, headers, body = parse(raw)
    assert status == 408 and raw.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert int(headers["content-length"]) == len(raw.partition(b"\r\n\r\n")[2])
    assert "2.5 s" in body["error"]["message"]


def test_the_cap_leaves_the_process_its_reserved_descriptors() -> None:
    assert connection_cap(4096, 1_048_576) == 4096
    assert connection_cap(4096, 1024) == 1024 - RESERVED_DESCRIPTORS
    assert connection_cap(4096, 100) == 1


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(connection_limits.resource, "getrlimit", lambda _: (1024, 65536))
    monkeypatch.setattr(connection_limits.resource, "setrlimit",
                        lambda kind, limits: calls.append((kind, limits)))
    assert raise_descriptor_limit() == 65536
    assert calls == [(resource.RLIMIT_NOFILE, (65536, 65536))]


def test_a_refused_raise_keeps_the_soft_limit(monkeypatch) -> None:
    def refuse(kind, limits):
        raise ValueError("not allowed")

    monkeypatch.setattr(connection_limits.resource, "getrlimit", lambda _: (1024, 65536))
    monkeypatch.setattr(connection_limits.resource, "setrlimit", refuse)
    assert raise_descriptor_limit() == 1024


def test_a_soft_limit_at_the_hard_one_is_left_alone(monkeypatch) -> None:
    monkeypatch.setattr(connection_limits.resource, "getrlimit", lambda _: (4096, 4096))
    monkeypatch.setattr(connection_limits.resource, "setrlimit",
                        lambda kind, limits: pytest.fail("no raise needed"))
    assert raise_descriptor_limit() == 4096
