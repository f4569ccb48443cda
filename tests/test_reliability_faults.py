"""Faults under load, through launch.py: the engine killed, the frontend killed, SIGTERM.

- kill -9 of the engine: every open stream gets an error event and ends within 2 s,
  waiting non-streaming requests get 503, /health turns 503, launch exits non-zero
  naming the engine.
- kill -9 of the frontend: launch stops the engine and exits non-zero naming the frontend.
- SIGTERM: new requests get 503 while in-flight ones finish; those still running at the
  shutdown timeout end with an error event; launch exits 0 and removes its private (0700)
  socket directory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from collections.abc import Awaitable
from pathlib import Path

import aiohttp
import pytest

from bench.launched import child_pids, command_line
from bench.soak import StreamOutcome, read_metrics, stream_one
from tests.launched_server import LaunchedServer, process_exists
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

DETECTION_LIMIT_S = 2.0
# Drains end long before the long streams (2,000 tokens, 6 running: ~3.5 s at the tiny
# model's ~1.8 ms a step on two cores; at 5 s, once sampling got fast, the engine finished
# them inside the drain) and long after the short ones, which run long enough (~0.4 s) for
# the metrics to see all six running.
SHUTDOWN_TIMEOUT_S = 1.5
SHORT_TOKENS = 200


def body(max_tokens: int, stream: bool = True) -> dict:
    return {"model": TINY_MODEL_NAME, "prompt": "The history of the world, part", "n": 1,
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def start(factory: pytest.TempPathFactory, *args: str) -> LaunchedServer:
    model = shared_tiny_model(factory)
    return tiny_server(model, "--num-kv-blocks", "2048", *args).start(factory.mktemp("logs"))


async def wait_running(session: aiohttp.ClientSession, server: LaunchedServer, count: int,
                       timeout_s: float = 60.0) -> None:
    """Until the engine reports `count` running requests, each with a token out."""
    async with asyncio.timeout(timeout_s):
        while True:
            samples = await read_metrics(session, server.base_url)
            if samples.get("loom:num_requests_running", 0) >= count:
                return
            await asyncio.sleep(0.05)


async def post_plain(session: aiohttp.ClientSession, url: str, max_tokens: int):
    async with session.post(url, json=body(max_tokens, stream=False)) as response:
        return response.status, await response.json(), time.monotonic()


async def poll_health(session: aiohttp.ClientSession, url: str, seconds: float):
    """(monotonic time, status or None when refused) every 20 ms."""
    seen: list[tuple[float, int | None]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=0.5)) as response:
                seen.append((time.monotonic(), response.status))
        except (aiohttp.ClientError, TimeoutError):
            seen.append((time.monotonic(), None))
            if len(seen) > 3 and all(status is None for _, status in seen[-3:]):
                break
        await asyncio.sleep(0.02)
    return seen


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def wait_exit(server: LaunchedServer, timeout_s: float = 30.0) -> int:
    return await asyncio.to_thread(server.process.wait, timeout_s)


async def test_engine_killed_under_load(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = start(tmp_path_factory)
    runtime_dir = runtime_dir_of(server)
    try:
        url = server.base_url + "/v1/completions"
        async with session() as http:
            watched = [StreamOutcome() for _ in range(6)]
            streams: list[Awaitable[StreamOutcome]] = [
                asyncio.ensure_future(stream_one(http, url, body(2000), outcome=outcome))
                for outcome in watched]
            plains = [asyncio.ensure_future(post_plain(http, url, 2000)) for _ in range(2)]
            await wait_running(http, server, 8)
            async with asyncio.timeout(30):  # every stream has tokens in hand before the kill
                while not all(outcome.chunks for outcome in watched):
                    await asyncio.sleep(0.01)
            engine = server.child("engine")
            killed_at = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            health = await poll_health(http, server.base_url + "/health", 5.0)
            outcomes = await asyncio.gather(*streams)
            answers = await asyncio.gather(*plains)
        for outcome in outcomes:
            assert outcome.status == 200 and outcome.chunks > 0
            assert outcome.finish_reason is None and outcome.error, outcome
            assert "engine" in outcome.error.lower()
            assert outcome.done  # the error event, then a clean end of stream
            assert outcome.ended - killed_at < DETECTION_LIMIT_S, outcome
        for status, payload, answered_at in answers:
            assert status == 503 and payload["error"]["type"] == "service_unavailable"
            assert answered_at - killed_at < DETECTION_LIMIT_S
        statuses = [status for _, status in health]
        assert 503 in statuses, health
        assert all(status != 200 for at, status in health if at - killed_at > 1.0), health
        assert await wait_exit(server) != 0
        assert "engine was killed by signal SIGKILL" in server.log
    finally:
        server.stop()
    assert not child_pids(server.process.pid)
    assert not runtime_dir.exists()


async def test_frontend_killed_stops_the_engine(tmp_path_factory: pytest.TempPathFactory):
    server = start(tmp_path_factory)
    try:
        engine = server.child("engine")
        os.kill(server.child("frontend"), signal.SIGKILL)
        assert await wait_exit(server) != 0
        assert "frontend was killed by signal SIGKILL" in server.log
        assert not process_exists(engine)
    finally:
        server.stop()


def runtime_dir_of(server: LaunchedServer) -> Path:
    argv = command_line(server.child("engine")).split()
    address = argv[argv.index("--requests-addr") + 1]
    return Path(address.removeprefix("ipc://")).parent


async def test_sigterm_drains_then_aborts_and_exits_zero(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    server = start(tmp_path_factory, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    runtime_dir = runtime_dir_of(server)
    mode = runtime_dir.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()
    children = child_pids(server.process.pid)
    try:
        url = server.base_url + "/v1/completions"
        async with session() as http:
            short = [asyncio.ensure_future(stream_one(http, url, body(SHORT_TOKENS)))
                     for _ in range(4)]
            long = [asyncio.ensure_future(stream_one(http, url, body(2000))) for _ in range(2)]
            await wait_running(http, server, 6)
            server.process.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
            refusals = await refused_while_draining(http, url)
            finished = await asyncio.gather(*short)
            aborted = await asyncio.gather(*long)
        assert all(o.completed and o.finish_reason == "length" for o in finished), finished
        for outcome in aborted:
            assert outcome.status == 200 and outcome.done, outcome
            assert "shutting down" in (outcome.error or ""), outcome
            assert outcome.ended - signalled_at < SHUTDOWN_TIMEOUT_S + 2.0
        assert refusals and all(code == "shutting_down" for code in refusals), refusals
        assert await wait_exit(server) == 0, server.log
    finally:
        server.stop()
    assert not runtime_dir.exists()
    assert not any(process_exists(pid) for pid in children)


async def refused_while_draining(http: aiohttp.ClientSession, url: str) -> list[str]:
    """Error codes of the new requests sent until the frontend stops listening (or 6 s)."""
    codes: list[str] = []
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline and len(codes) < 3:
        try:
            async with http.post(url, json=body(4, stream=False)) as response:
                if response.status == 503:
                    codes.append((await response.json())["error"]["code"])
        except aiohttp.ClientError:
            break
        await asyncio.sleep(0.1)
    return codes
