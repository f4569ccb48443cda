"""Property-based fuzzing of the wire: whatever bytes arrive, decoding raises FrameError at
worst, the frontend's output reader drops what it cannot use, and a request fed garbage
ends with EngineRequestError rather than a crash."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common import protocol
from common.protocol import (
    PROTOCOL_VERSION,
    AddRequest,
    FrameError,
    Kind,
    RequestOutput,
    StepOutputs,
    StepStats,
)
from common.sampling import SamplingParams
from common.sockets import Endpoints
from frontend.engine_client import EngineClient
from frontend.generation import Generation
from frontend.logprobs_format import ChatLogprobs, CompletionLogprobs
from frontend.request_stream import EngineRequestError
from frontend.token_texts import TokenTexts
from tests.fake_engine import build_test_tokenizer

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

keys = st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20)
scalars = keys | st.none() | st.floats() | st.binary(max_size=40)
structures = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(keys, children, max_size=4),
    max_leaves=30,
)
kinds = st.sampled_from([kind.value for kind in Kind]) | st.integers(-5, 300)
token_blobs = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8).map(
    protocol.pack_token_ids)
near_outputs = st.lists(
    st.tuples(st.sampled_from(["r0", "r1", "r2", "nobody"]) | st.text(max_size=3),
              token_blobs | structures,
              st.sampled_from([None, "stop", "length", "abort"]) | structures,
              st.integers(-3, 2**40) | structures,
              st.none() | structures).map(list),
    max_size=4)
near_stats = st.lists(st.integers(-10, 10**6) | st.floats(allow_nan=True),
                      min_size=len(StepStats.__slots__), max_size=len(StepStats.__slots__))


def frame_of(fields: list[Any]) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


near_frames = st.one_of(
    st.tuples(kinds, st.lists(structures, max_size=7)).map(
        lambda kf: frame_of([PROTOCOL_VERSION, kf[0], *kf[1]])),
    st.tuples(st.integers(0, 2**40), near_outputs, near_stats | structures).map(
        lambda f: frame_of([PROTOCOL_VERSION, Kind.OUTPUTS.value, *f])),
)
any_frame = st.binary(max_size=300) | structures.map(frame_of) | near_frames


@given(frame=any_frame)
@FUZZ
def test_decode_raises_only_frame_error(frame: bytes) -> None:
    try:
        message = protocol.decode(frame)
    except FrameError:
        event("refused")
        return
    event(f"decoded {type(message).__name__}")
    assert type(message) in protocol._TYPE_OF.values()
    protocol.decode(protocol.encode(message))  # what decodes also re-encodes


def test_decode_refuses_oversized_frames_and_huge_declared_lengths() -> None:
    with pytest.raises(FrameError):
        protocol.decode(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))
    # An array header claiming 2**32 - 1 elements, with none following.
    with pytest.raises(FrameError):
        protocol.decode(b"\xdd\xff\xff\xff\xff")
    with pytest.raises(FrameError):
        protocol.decode(b"\xdb\x7f\xff\xff\xff" + b"x" * 10)


@pytest.fixture(scope="module")
def client() -> Iterator[EngineClient]:
    # Nothing listens on these endpoints: ADDs just queue up inside ZeroMQ.
    endpoints = Endpoints.private_ipc()
    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(_make_client(endpoints))
    yield client
    loop.run_until_complete(client.close())
    loop.close()
    endpoints.remove()


async def _make_client(endpoints: Endpoints) -> EngineClient:
    return EngineClient(endpoints.requests, endpoints.outputs)


def add_request(request_id: str, logprobs: int | None = None) -> AddRequest:
    return AddRequest(request_id, [1, 2], SamplingParams(max_tokens=8, logprobs=logprobs),
                      time.time())


@given(frames=st.lists(any_frame, max_size=8))
@FUZZ
def test_output_reader_survives_any_frames(client: EngineClient, frames: list[bytes]) -> None:
    streams = [client.add(add_request(f"r{i}")) for i in range(3)]
    try:
        for frame in frames:
            client.handle_frame(frame)  # must not raise
        valid = StepOutputs(7, [RequestOutput("r1", [42], "stop")], StepStats(num_running=1))
        client.handle_frame(protocol.encode(valid))
        assert client.last_step == 7 and client.last_stats.num_running == 1
    finally:
        for stream in streams:
            stream.close()
    assert client.num_in_flight == 0


raw_logprobs = st.lists(
    st.tuples(st.floats() | structures,
              st.lists(st.tuples(st.integers(-5, 10**6), st.floats()).map(list), max_size=3)
              | structures).map(list)
    | structures,
    max_size=4,
)
outputs = st.lists(
    st.tuples(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5),
              st.none() | raw_logprobs),
    min_size=1, max_size=5)


@given(steps=outputs, logprobs=st.sampled_from([None, 0, 3]),
       finish=st.sampled_from(["stop", "length", "abort", "bogus"]))
@FUZZ
def test_a_request_fed_garbage_fails_cleanly(
    client: EngineClient, steps: list[tuple[list[int], Any]], logprobs: int | None, finish: str
) -> None:
    tokenizer = build_test_tokenizer()
    texts = TokenTexts(tokenizer)

    async def run() -> None:
        request = add_request("g", logprobs)
        generation = Generation(client, tokenizer, request, ["zz"], [tokenizer.eos_token_id])
        async with generation:
            for index, (token_ids, raw) in enumerate(steps):
                last = index == len(steps) - 1
                output = RequestOutput("g", token_ids, finish if last else None, 0, raw)
                client.handle_frame(protocol.encode(StepOutputs(index, [output])))
            try:
                async for delta in generation.deltas():
                    ChatLogprobs(texts).format(delta.logprobs)
                    CompletionLogprobs(texts).format(delta.logprobs)
            except EngineRequestError:
                event("refused by the frontend")
            else:
                event("served")

    asyncio.run(run())
