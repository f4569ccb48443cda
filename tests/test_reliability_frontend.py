"""The frontend's own reliability parts against the fake engine: the drain on shutdown,
the engine-process sentinel, overload admission."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.sockets import Endpoints
from frontend.__main__ import drain
from frontend.admission import Admission
from frontend.app import create_app
from frontend.errors import APIError
from frontend.metrics import LoomMetrics
from frontend.state import STATE, EngineAddress, FrontendSettings
from tests.fake_engine import MODEL_NAME, FakeEngine, build_test_tokenizer, engine_info


@contextlib.asynccontextmanager
async def serving(engine_pid: int | None = None,
                  **settings: Any) -> AsyncIterator[tuple[FakeEngine, TestClient]]:
    """The real app, configured with `settings`, in front of a fake engine (whose process
    the frontend takes `engine_pid` to be)."""
    tokenizer = build_test_tokenizer()
    info = engine_info(tokenizer)
    endpoints = Endpoints.private_ipc()
    engine = FakeEngine(endpoints, list(info.eos_token_ids))
    engine.reply = lambda request: tokenizer.encode(" word", add_special_tokens=False)
    engine.step_interval_s = 0.01
    address = EngineAddress(endpoints.requests, endpoints.outputs, engine_pid)
    app = create_app(FrontendSettings(MODEL_NAME, [address], info, **settings), tokenizer)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await engine.start()
    await client.start_server()
    try:
        yield engine, client
    finally:
        await client.close()
        await engine.stop()
        endpoints.remove()


def events(raw: bytes) -> list[Any]:
    lines = [line for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines]


async def stream(client: TestClient, max_tokens: int) -> list[Any]:
    body = {"prompt": "Hi", "max_tokens": max_tokens, "stream": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    return events(await response.read())


async def test_drain_refuses_new_requests_and_lets_open_ones_finish() -> None:
    async with serving() as (engine, client):
        running = asyncio.create_task(stream(client, 30))  # ~0.3 s of steps
        await engine.wait_for(lambda: engine.num_running == 1)
        draining = asyncio.create_task(drain(client.app, timeout_s=5.0))
        await engine.wait_for(lambda: client.app[STATE].drain.draining)
        refused = await client.post("/v1/completions", json={"prompt": "Hi"})
        assert refused.status == 503
        assert (await refused.json())["error"]["code"] == "shutting_down"
        assert (await client.get("/health")).status == 503
        finished = await running
        await draining
    assert finished[-2]["choices"][0]["finish_reason"] == "length" and finished[-1] == "[DONE]"
    assert not engine.aborted


async def test_drain_aborts_what_outlives_the_timeout() -> None:
    async with serving() as (engine, client):
        running = asyncio.create_task(stream(client, 200))  # ~2 s of steps
        await engine.wait_for(lambda: engine.num_running == 1)
        started = time.monotonic()
        await drain(client.app, timeout_s=0.2)
        received = await running
        assert time.monotonic() - started < 1.0
        await engine.wait_for(lambda: len(engine.aborted) == 1)
    assert received[-1] == "[DONE]"
    assert received[-2]["error"]["code"] == "shutting_down"


async def test_the_engine_sentinel_fails_open_streams_at_once() -> None:
    # A stand-in process plays the engine's part for the sentinel; the fake engine keeps
    # its sockets open, so only the sentinel can tell.
    # Repeated: frames keep arriving while the failure is decided, and a race there once
    # stalled the stream until the client's timeout.
    for _ in range(5):
        stand_in = subprocess.Popen(["sleep", "60"])
        try:
            async with serving(engine_pid=stand_in.pid) as (engine, client):
                running = asyncio.create_task(stream(client, 200))  # 2 s of 10 ms steps
                await engine.wait_for(lambda: engine.num_running == 1)
                stand_in.kill()
                started = time.monotonic()
                received = await asyncio.wait_for(running, 30)
                assert time.monotonic() - started < 1.5
                assert received[-2]["error"]["code"] == "engine_unavailable"
                assert (await client.get("/health")).status == 503
                late = await client.post("/v1/completions", json={"prompt": "Hi"})
                assert late.status == 503
        finally:
            stand_in.kill()
            stand_in.wait()


def test_admission_bounds_the_waiting_choices() -> None:
    admission = Admission(max_waiting=3)
    engine = SimpleNamespace(num_waiting_estimate=0, metrics=LoomMetrics())
    admission.admit(engine, 5)  # nothing waits: even a request past the bound runs
    engine.num_waiting_estimate = 1
    admission.admit(engine, 2)
    engine.num_waiting_estimate = 2
    with pytest.raises(APIError) as refused:
        admission.admit(engine, 2)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
    assert refused.value.code == "server_overloaded"
    admission.admit(engine, 2, within_share=True)  # a tenant within its share still enters


async def test_waiting_is_in_flight_minus_running() -> None:
    async with serving() as (engine, client):
        state = client.app[STATE]
        body = {"prompt": "Hi", "max_tokens": 50, "stream": True, "n": 3}
        response = await client.post("/v1/completions", json=body)
        (engine_client,) = state.engine.clients
        await engine.wait_for(lambda: engine_client.last_stats.num_running == 3)
        assert engine_client.num_in_flight == 3 and engine_client.num_waiting_estimate == 0
        assert state.engine.num_waiting_estimate == 0
        response.close()
