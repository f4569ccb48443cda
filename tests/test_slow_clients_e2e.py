"""Slow clients against launch.py on the tiny model, over real sockets to 127.0.0.1, as an
attacker would send them: headers or a body trickled a byte at a time get a 408 and a
closed connection once the request read timeout passes; a slow reader of a long stream is
not cut; 2,000 connections trickling a body byte every 5 s are held while normal requests
are still answered promptly, and connections beyond the cap get a 503 and are closed."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

READ_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1.0
SLACK_S = 5.0  # a busy shared CPU
TRICKLING = 2000
CAP = TRICKLING + 10  # room for the trickles, a normal request and a metrics scrape
PACE_S = 5.0  # the attack's pace: one body byte per connection every 5 s
PROMPT_LATENCY_S = 3.0
# A stream the slow reader below takes longer than both limits to read (the test checks that
# it did); tokens that queue up while it reads arrive merged, several to an event.
STREAMED_TOKENS = 300
COMPLETION = json.dumps({"model": TINY_MODEL_NAME, "prompt": "Hello", "max_tokens": 4}).encode()


def head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.fixture(scope="module")
def short_limits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512",
                           "--request-read-timeout", str(READ_TIMEOUT_S),
                           "--keep-alive-timeout", str(KEEP_ALIVE_S))
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log
    assert_no_frontend_errors(launched.log)


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    raise_own_descriptor_limit(TRICKLING + 500)
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512",
                           "--max-connections", str(CAP))
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log
    assert_no_frontend_errors(launched.log)


def assert_no_frontend_errors(log: str) -> None:
    for mark in ("Error handling request", "unhandled error", "Exception in callback",
                 "exception was never retrieved"):
        assert mark not in log, log


def raise_own_descriptor_limit(needed: int) -> None:
    """The test's own sockets: its soft limit up to the hard one, which must hold them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard == resource.RLIM_INFINITY or hard >= needed, (
        f"this test opens {needed} sockets; the hard descriptor limit is {hard}")
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def connect(server: LaunchedServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def read_reply(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int, dict]:
    """The server's whole answer, up to its closing the connection."""
    async with asyncio.timeout(timeout_s):
        raw = await reader.read()
    status_line, _, rest = raw.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 "), raw[:200]
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)


async def trickle_until_answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                 pace_s: float, timeout_s: float) -> tuple[int, dict, float]:
    started = time.monotonic()
    answer = asyncio.ensure_future(read_reply(reader, timeout_s))
    while not answer.done():
        try:
            writer.write(b"x")
            await writer.drain()
        except ConnectionError:
            pass  # the server closed on us: its answer is in the reader
        await asyncio.wait([answer], timeout=pace_s)
    writer.close()
    status, body = answer.result()
    return status, body, time.monotonic() - started


async def test_trickled_headers_get_a_408_and_a_closed_connection(short_limits):
    reader, writer = await connect(short_limits)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    status, body, elapsed = await trickle_until_answered(reader, writer, 0.2,
                                                         READ_TIMEOUT_S + SLACK_S)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert elapsed >= READ_TIMEOUT_S - 0.1


async def test_a_trickled_body_gets_a_408_and_a_closed_connection(short_limits):
    reader, writer = await connect(short_limits)
    writer.write(head(len(COMPLETION)) + COMPLETION[:1])
    status, body, elapsed = await trickle_until_answered(reader, writer, 0.2,
                                                         READ_TIMEOUT_S + SLACK_S)
    assert status == 408
    assert body["error"]["code"] == "request_timeout" and "body" in body["error"]["message"]
    assert elapsed >= READ_TIMEOUT_S - 0.1
    metrics = scrape(short_limits)
    assert metrics['loom:http_connections_closed_total{reason="read_timeout"}'] >= 1


async def test_a_connection_that_sends_nothing_is_closed(short_limits):
    reader, writer = await connect(short_limits)
    started = time.monotonic()
    async with asyncio.timeout(KEEP_ALIVE_S + SLACK_S):
        assert await reader.read() == b""
    assert time.monotonic() - started >= KEEP_ALIVE_S - 0.1
    writer.close()


async def test_a_slow_reader_of_a_long_stream_is_not_cut(short_limits):
    request = json.dumps({"model": TINY_MODEL_NAME, "prompt": "Hello", "stream": True,
                          "max_tokens": STREAMED_TOKENS, "ignore_eos": True,
                          "stream_options": {"include_usage": True}}).encode()
    reader, writer = await connect(short_limits)
    writer.write(head(len(request)) + request)
    started = time.monotonic()
    received = b""
    async with asyncio.timeout(120):
        while b"data: [DONE]" not in received:
            chunk = await reader.read(64)
            assert chunk, f"cut after {time.monotonic() - started:.1f} s"
            received += chunk
            await asyncio.sleep(0.02)  # a steady reader that takes its time
    writer.close()
    assert time.monotonic() - started > READ_TIMEOUT_S + KEEP_ALIVE_S
    assert f'"completion_tokens": {STREAMED_TOKENS}'.encode() in received
    assert b'"finish_reason": "length"' in received


def scrape(server: LaunchedServer) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {match[1]: float(match[2])
            for match in re.finditer(r"^(loom:http_\S+) (\S+)$", text, re.MULTILINE)}


async def scrape_once_admitted(server: LaunchedServer) -> dict[str, float]:
    """A scrape that may first meet the cap (503) while the server is closing connections
    the client has just closed."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await asyncio.to_thread(scrape, server)
        except urllib.error.HTTPError as error:
            assert error.code == 503 and time.monotonic() < deadline, error
        await asyncio.sleep(0.1)


def normal_request(server: LaunchedServer) -> float:
    started = time.monotonic()
    request = urllib.request.Request(f"{server.base_url}/v1/completions", data=COMPLETION,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["choices"][0]["finish_reason"] == "length"
    return time.monotonic() - started


async def test_2000_trickling_connections_are_held_and_normal_requests_still_served(attacked):
    assert f"at most {CAP} connections" in attacked.log  # the tree under test serves
    baseline = [await asyncio.to_thread(normal_request, attacked) for _ in range(5)]
    trickles = [await connect(attacked) for _ in range(TRICKLING)]
    for _, writer in trickles:
        writer.write(head(1000) + b"{")
    stop = asyncio.Event()
    pacer = asyncio.create_task(trickle_all(trickles, stop))
    try:
        await wait_until(lambda: scrape(attacked)["loom:http_connections_open"] >= TRICKLING,
                         timeout_s=60)
        under_attack = [await asyncio.to_thread(normal_request, attacked) for _ in range(10)]
        refused = await over_the_cap(attacked, extra=20)
        held = await scrape_once_admitted(attacked)  # the refused ones gone
        assert held["loom:http_connections_open"] >= TRICKLING  # every trickle still open
        assert held.get('loom:http_connections_closed_total{reason="read_timeout"}', 0) == 0
    finally:
        stop.set()
        await pacer
        for _, writer in trickles:
            writer.close()
    print(f"\nnormal request latency: alone p50 {statistics.median(baseline):.3f} s, "
          f"max {max(baseline):.3f} s; beside {TRICKLING} trickling connections p50 "
          f"{statistics.median(under_attack):.3f} s, max {max(under_attack):.3f} s; "
          f"{refused} of 20 connections over the cap refused")
    assert max(under_attack) < PROMPT_LATENCY_S
    assert refused >= 20 - (CAP - TRICKLING)
    async with asyncio.timeout(30):
        while (await scrape_once_admitted(attacked))["loom:http_connections_open"] > 1:
            await asyncio.sleep(0.2)


async def trickle_all(trickles, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with asyncio.timeout(PACE_S):
                await stop.wait()
        except TimeoutError:
            for _, writer in trickles:
                writer.write(b" ")


async def over_the_cap(server: LaunchedServer, extra: int) -> int:
    """Opens `extra` connections past the trickles: those over the cap get a 503 at once
    and are closed; counts them."""
    connections = [await connect(server) for _ in range(extra)]

    async def answered(reader: asyncio.StreamReader) -> bool:
        try:
            status, body = await read_reply(reader, timeout_s=SLACK_S)
        except TimeoutError:
            return False  # accepted: below the cap
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        return True

    refusals = await asyncio.gather(*(answered(reader) for reader, _ in connections))
    for _, writer in connections:
        writer.close()
    return sum(refusals)


async def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)
