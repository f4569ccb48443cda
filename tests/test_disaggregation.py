"""The frontend's side of prefill/decode disaggregation (frontend.disaggregation), over fake
engine clients: the two legs as one stream, a request ending at its first token, a prefill
engine dying before it, a client leaving before the decode leg, and --kv-roles parsing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from common.protocol import AddRequest, FinishReason, RequestOutput
from common.sampling import SamplingParams
from frontend.disaggregation import DisaggregatedStream, PrefillDecodeRoute, parse_kv_roles
from frontend.request_stream import EngineDeadError, StreamFailure

REQUEST = AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), 0.0)


@dataclass
class FakeStream:
    items: list
    closed: bool = False
    finished: bool = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, StreamFailure):
            raise item.error
        self.finished = item.finish_reason is not None
        return item

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeClient:
    """Replies to each add with the next scripted stream; records what it was sent."""

    scripts: list[list]
    rank: int = 0
    added: list[AddRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    kv_sinks: dict = field(default_factory=dict)

    def add(self, request: AddRequest) -> FakeStream:
        self.added.append(request)
        self.streams.append(FakeStream(self.scripts.pop(0)))
        return self.streams[-1]

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def relay_kv(self, parts: list) -> None: ...


def route(prefill_script: list, decode_scripts: list[list]) -> PrefillDecodeRoute:
    return PrefillDecodeRoute(FakeClient([prefill_script]), FakeClient(decode_scripts),  # type: ignore[arg-type]
                              {(1, 2, 3): 1})


async def read_all(stream: DisaggregatedStream) -> list[RequestOutput]:
    return [output async for output in stream]


def test_the_legs_read_as_one_stream() -> None:
    legs = route([RequestOutput("r1", [7], FinishReason.LENGTH, num_cached_tokens=16)],
                 [[RequestOutput("r1", [8, 9], None, 99), RequestOutput("r1", [10, 11], "length")]])
    stream = DisaggregatedStream(legs, REQUEST)
    prefill_leg = legs.prefill.added[0]  # type: ignore[attr-defined]
    assert prefill_leg.export_kv and prefill_leg.sampling.max_tokens == 1
    assert prefill_leg.kv_skip_blocks == 1  # the decode engine was sent one block before
    assert legs.prefill.kv_sinks["r1"] == legs.decode.relay_kv
    outputs = asyncio.run(read_all(stream))
    assert [o.new_token_ids for o in outputs] == [[7], [8, 9], [10, 11]]
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    assert {o.num_cached_tokens for o in outputs} == {16}  # the prefill engine's hit
    decode_leg = legs.decode.added[0]  # type: ignore[attr-defined]
    assert decode_leg.output_token_ids == [7] and not decode_leg.export_kv
    assert decode_leg.sampling.max_tokens == 5
    assert "r1" not in legs.prefill.kv_sinks and stream.finished


def test_a_request_ending_at_its_first_token_has_no_decode_leg() -> None:
    legs = route([RequestOutput("r1", [2], FinishReason.STOP)], [])
    stream = DisaggregatedStream(legs, REQUEST)
    outputs = asyncio.run(read_all(stream))
    assert [o.finish_reason for o in outputs] == ["stop"] and legs.decode.added == []  # type: ignore[attr-defined]
    stream.close()
    assert legs.decode.aborted == []  # type: ignore[attr-defined]


def test_a_prefill_engine_dying_first_sends_the_request_whole_to_decode() -> None:
    gone = StreamFailure(EngineDeadError("engine 0 is gone"), engine_gone=True)
    legs = route([gone], [[RequestOutput("r1", [5, 6, 7, 8, 9], "length")]])
    stream = DisaggregatedStream(legs, REQUEST)
    outputs = asyncio.run(read_all(stream))
    assert [o.new_token_ids for o in outputs] == [[5, 6, 7, 8, 9]]
    assert legs.decode.added == [REQUEST]  # type: ignore[attr-defined]
    assert "r1" not in legs.prefill.kv_sinks


def test_leaving_before_the_decode_leg_aborts_both_sides() -> None:
    legs = route([RequestOutput("r1", [7], FinishReason.LENGTH)], [])
    stream = DisaggregatedStream(legs, REQUEST)
    stream.close()  # the client left while the prompt was prefilling
    assert legs.prefill.streams[0].closed  # type: ignore[attr-defined]
    assert legs.decode.aborted == ["r1"]  # type: ignore[attr-defined]  # its relayed blocks go
    assert "r1" not in legs.prefill.kv_sinks


def test_requests_that_cannot_split_run_whole_on_the_decode_engine() -> None:
    legs = route([], [[], [], []])
    for sampling in (SamplingParams(max_tokens=1), SamplingParams(max_tokens=4, pooling="last"),
                     SamplingParams(max_tokens=4, grammars=['{"type": "object"}'])):
        request = AddRequest("r", [1], sampling, 0.0)
        assert not isinstance(legs.add(request), DisaggregatedStream)
    assert len(legs.decode.added) == 3 and legs.prefill.added == []  # type: ignore[attr-defined]


def test_kv_roles_take_loom_and_vllm_names() -> None:
    assert parse_kv_roles("prefill, decode,both", 3) == ["prefill", "decode", "both"]
    assert parse_kv_roles("kv_producer,kv_consumer,kv_both", 3) == ["prefill", "decode", "both"]
    with pytest.raises(ValueError, match="unknown KV role 'middle'"):
        parse_kv_roles("prefill,middle", 2)
    with pytest.raises(ValueError, match="1 KV roles for 2 engines"):
        parse_kv_roles("prefill", 2)
