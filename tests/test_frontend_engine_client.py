"""EngineClient against the fake engine: routing, merging, ABORTs, bad frames, engine death."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from common.curve import CurveKeys
from common.protocol import (
    AddRequest,
    Ready,
    RequestOutput,
    StepOutputs,
    encode,
)
from common.sampling import SamplingParams
from common.sockets import Endpoints, free_port
from frontend.engine_client import EngineClient
from frontend.engine_pool import EnginePool
from frontend.request_stream import EngineDeadError, EngineRequestError
from frontend.router import Router
from tests.fake_engine import FakeEngine, fake_logprobs

EOS = 0


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    endpoints = Endpoints.private_ipc()
    fake = FakeEngine(endpoints, [EOS])
    await fake.start()
    yield fake
    await fake.stop()
    endpoints.remove()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[EngineClient]:
    client = EngineClient(engine.endpoints.requests, engine.endpoints.outputs)
    client.start()
    yield client
    await client.close()


def request(request_id: str, max_tokens: int = 4, **sampling: object) -> AddRequest:
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return AddRequest(request_id, [1, 2, 3], params, time.time())


async def collect(client: EngineClient, add: AddRequest) -> list[RequestOutput]:
    async with client.add(add) as outputs:
        return [output async for output in outputs]


async def test_concurrent_requests_get_their_own_tokens(
    engine: FakeEngine, client: EngineClient
) -> None:
    engine.reply = lambda add: [int(add.request_id[1:])]
    results = await asyncio.gather(*(collect(client, request(f"r{i}")) for i in range(1, 6)))
    for i, outputs in enumerate(results, start=1):
        tokens = [t for output in outputs for t in output.new_token_ids]
        assert tokens == [i] * 4
        assert outputs[-1].finish_reason == "length"
    assert client.num_in_flight == 0
    assert engine.aborted == []  # finished requests are not aborted


async def test_queued_outputs_are_merged(engine: FakeEngine, client: EngineClient) -> None:
    engine.reply = lambda add: [7, 8, 9]
    async with client.add(request("r1", max_tokens=6)) as outputs:
        await engine.wait_for(lambda: outputs.num_pending == 6)  # one output per step
        merged = [output async for output in outputs]
    assert len(merged) == 1
    assert merged[0].new_token_ids == [7, 8, 9, 7, 8, 9]
    assert merged[0].finish_reason == "length"


async def test_merged_outputs_keep_their_logprobs(
    engine: FakeEngine, client: EngineClient
) -> None:
    engine.reply = lambda add: [7, 8]
    async with client.add(request("r1", max_tokens=1000, logprobs=1)) as outputs:
        await engine.wait_for(lambda: outputs.num_pending >= 3)
        client.abort(["r1"])  # its marker output carries no tokens and no logprobs
        merged = [output async for output in outputs]
    assert len(merged) == 1 and merged[0].finish_reason == "abort"
    assert merged[0].logprobs is not None
    assert len(merged[0].logprobs) == len(merged[0].new_token_ids) >= 3
    assert merged[0].logprobs[:2] == [fake_logprobs(7, 1), fake_logprobs(8, 1)]


async def test_leaving_early_aborts(engine: FakeEngine, client: EngineClient) -> None:
    async with client.add(request("r1", max_tokens=1000)) as outputs:
        async for _ in outputs:
            break
    await engine.wait_for(lambda: engine.aborted == ["r1"])
    assert client.num_in_flight == 0


async def test_cancelled_consumer_aborts(engine: FakeEngine, client: EngineClient) -> None:
    engine.step_interval_s = 0.01
    task = asyncio.create_task(collect(client, request("r1", max_tokens=1000)))
    await engine.wait_for(lambda: engine.num_running == 1)
    task.cancel()
    await engine.wait_for(lambda: engine.aborted == ["r1"])


async def test_explicit_abort_ends_the_stream(engine: FakeEngine, client: EngineClient) -> None:
    engine.step_interval_s = 0.01
    async with client.add(request("r1", max_tokens=1000)) as outputs:
        await anext(outputs)
        client.abort(["r1"])
        rest = [output async for output in outputs]
    assert rest[-1].finish_reason == "abort"
    await engine.wait_for(lambda: engine.aborted == ["r1"])


async def test_bad_frames_are_dropped(engine: FakeEngine, client: EngineClient) -> None:
    await engine.send_raw(b"garbage")
    await engine.send_raw(b"\x93\x01\x0b\x01")  # OUTPUTS with a missing field
    await engine.send(Ready("m", 10, 1, 16, [0], 100))  # not a frontend message
    await engine.send(StepOutputs(1, [RequestOutput("nobody", [1], None)]))  # unknown id: ignored
    outputs = await collect(client, request("r1", max_tokens=2))
    assert [t for output in outputs for t in output.new_token_ids] == [5, 6]
    assert client.num_bad_frames == 3


async def test_engine_error_is_raised(engine: FakeEngine, client: EngineClient) -> None:
    engine.refuse = lambda add: "too long"
    with pytest.raises(EngineRequestError, match="too long"):
        await collect(client, request("r1"))
    assert client.num_in_flight == 0


async def test_engine_death_fails_in_flight_requests(
    engine: FakeEngine, client: EngineClient
) -> None:
    engine.step_interval_s = 0.01
    task = asyncio.create_task(collect(client, request("r1", max_tokens=1000)))
    await engine.wait_for(lambda: engine.num_running == 1)
    await engine.stop()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, timeout=5)
    assert client.engine_dead
    with pytest.raises(EngineDeadError):
        client.add(request("r2"))


async def test_remote_engines_must_serve_the_model_of_the_first_to_join() -> None:
    """Two tcp engine links (CURVE keys of a test secret, bound on 127.0.0.1): the first
    READY sets the model; another engine announcing a different one stays out."""
    keys = CurveKeys.derive(b"a test secret of enough bytes")
    ports = [free_port() for _ in range(4)]
    clients = [EngineClient(f"tcp://127.0.0.1:{ports[2 * rank]}",
                            f"tcp://127.0.0.1:{ports[2 * rank + 1]}", rank=rank, curve=keys)
               for rank in range(2)]
    pool = EnginePool(clients, Router("load", 16), clients[0].metrics)
    try:
        assert pool.engine_dead and pool.reported_info() is None  # nobody joined yet
        tiny = Ready("tiny", 256, 64, 16, [EOS], 128)
        clients[0].handle_frame(encode(tiny))
        assert not clients[0].engine_dead and pool.reported_info() == tiny
        clients[1].handle_frame(encode(Ready("other", 256, 64, 16, [EOS], 999)))
        assert clients[1].engine_dead and pool.num_live == 1
        clients[1].handle_frame(encode(tiny))
        assert pool.num_live == 2
    finally:
        for engine_client in clients:
            await engine_client.close()


async def test_a_client_whose_sockets_fail_to_open_leaves_no_context_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tcp link whose outputs port is taken: the requests socket it bound first and the
    ZAP handler are closed with the context, which would otherwise wait on them for ever."""
    contexts: list[zmq.asyncio.Context] = []

    class RecordedContext(zmq.asyncio.Context):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            contexts.append(self)

    monkeypatch.setattr(zmq.asyncio, "Context", RecordedContext)
    keys = CurveKeys.derive(b"a test secret of enough bytes")
    holder = zmq.Context()
    taken = holder.socket(zmq.PULL)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(zmq.ZMQError):
            EngineClient(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{port}",
                         curve=keys)
    finally:
        holder.destroy(linger=0)
    assert len(contexts) == 1 and contexts[0].closed
