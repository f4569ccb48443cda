"""Wire protocol: every message round-trips; anything malformed raises FrameError."""

from __future__ import annotations

import msgpack
import pytest

from common.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    FrameError,
    Kind,
    KVBlocks,
    Ready,
    RequestError,
    RequestOutput,
    Shutdown,
    StepOutputs,
    StepStats,
    decode,
    decode_message,
    encode,
)
from common.sampling import SamplingParams

MESSAGES = [
    AddRequest("req-1", [1, 2, 3, 2**31 - 1], SamplingParams(), 12.5),
    AddRequest("req-2", list(range(5000)),
               SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3,
                              stop_token_ids=[5], logit_bias={11: -100.0, 3: 2.5},
                              logprobs=2, ignore_eos=True, min_tokens=2),
               1.0, priority=-3),
    AddRequest("req-4", [9], SamplingParams(), 2.0, tenant="team-a", tenant_weight=2.5,
               timeout_s=1.5),
    AbortRequests(["a", "b"]),
    AbortRequests([]),
    Shutdown(),
    Ready("SmolLM2", 8192, 1000, 16, [2], 49152),
    Ready("SmolLM2", 8192, 1000, 16, [2], 49152, priority_scheduling=True),
    StepOutputs(7, [RequestOutput("a", [4], None, 0, None),
                    RequestOutput("b", [5], "stop", 16, [[-0.1, [[5, -0.1], [6, -2.0]]]], 0.125)],
                StepStats(2, 1, 0.25, 3, 100, 2, 0.05, 10, 4, 1, True, 2)),
    StepOutputs(8, [], StepStats()),
    StepOutputs(10, [RequestOutput("e", [7], "length", 32, None, 0.5,
                                   b"\x00\x00\x80\x3f" * 3)], StepStats()),
    StepOutputs(9, [RequestOutput("c", [4, 5, 6], None, 0, None)],
                StepStats(spec_decode_num_drafts_total=3, spec_decode_num_draft_tokens_total=9,
                          spec_decode_num_accepted_tokens_total=5,
                          spec_decode_accepted_by_position_total=[3, 2, 0])),
    RequestError("req-3", "prompt too long"),
    RequestError("req-5", "never started", RequestError.DEADLINE_EXCEEDED),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


def frame(*items) -> bytes:
    return msgpack.packb(list(items))


NO_TENANT = ("", 1.0, None)  # an ADD's tenant, tenant weight and timeout when unset

MALFORMED = {
    "not msgpack": b"\xc1\xc1\xc1",
    "truncated": encode(MESSAGES[1])[:-3],
    "not an array": msgpack.packb({"kind": 1}),
    "empty array": frame(),
    "wrong version": frame(PROTOCOL_VERSION + 1, Kind.SHUTDOWN),
    "unknown kind": frame(PROTOCOL_VERSION, 99),
    "kind is a string": frame(PROTOCOL_VERSION, "ADD"),
    "missing fields": frame(PROTOCOL_VERSION, Kind.ADD, "id"),
    "extra fields": frame(PROTOCOL_VERSION, Kind.SHUTDOWN, 1),
    "token ids not bytes": frame(PROTOCOL_VERSION, Kind.ADD, "id", [1, 2], {}, 0.0, 0, *NO_TENANT),
    "token ids odd length": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"\x01\x02\x03", {}, 0.0, 0,
                                  *NO_TENANT),
    "request id not str": frame(PROTOCOL_VERSION, Kind.ADD, 5, b"", {}, 0.0, 0, *NO_TENANT),
    "unknown sampling field": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {"bogus": 1}, 0.0, 0,
                                    *NO_TENANT),
    "invalid sampling value": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"",
                                    {"max_tokens": 0}, 0.0, 0, *NO_TENANT),
    "sampling not a map": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", [1], 0.0, 0, *NO_TENANT),
    "priority is bool": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, True, *NO_TENANT),
    "tenant not str": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, 0, 7, 1.0, None),
    "tenant name too long": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, 0, "t" * 257,
                                  1.0, None),
    "tenant weight zero": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, 0, "a", 0, None),
    "tenant weight nan": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, 0, "a",
                               float("nan"), None),
    "timeout negative": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, 0, "", 1.0, -1.0),
    "timeout infinite": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, 0, "", 1.0,
                              float("inf")),
    "timeout a string": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {}, 0.0, 0, "", 1.0, "1"),
    "priority_scheduling not bool": frame(PROTOCOL_VERSION, Kind.READY, "m", 1, 1, 1, [], 1, 1,
                                          PROTOCOL_VERSION),
    "error code not str": frame(PROTOCOL_VERSION, Kind.ERROR, "id", "reason", 3),
    "abort ids not list": frame(PROTOCOL_VERSION, Kind.ABORT, "a"),
    "abort id not str": frame(PROTOCOL_VERSION, Kind.ABORT, [1]),
    "outputs entry short": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1, [["a"]], StepStats().to_wire()),
    "queue time is a string": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1,
                                    [["a", b"", None, 0, None, "1", None]],
                                    StepStats().to_wire()),
    "queue time is a bool": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1,
                                  [["a", b"", None, 0, None, True, None]], StepStats().to_wire()),
    "embedding not bytes": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1,
                                 [["a", b"", "length", 0, None, None, [0.5]]],
                                 StepStats().to_wire()),
    "embedding not float32s": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1,
                                    [["a", b"", "length", 0, None, None, b"\x00" * 6]],
                                    StepStats().to_wire()),
    "unknown pooling": frame(PROTOCOL_VERSION, Kind.ADD, "id", b"", {"pooling": "max"}, 0.0, 0,
                             *NO_TENANT),
    "stats wrong size": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1, [], [1, 2]),
    "stats wrong type": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1, [],
                              ["x"] * len(StepStats.__slots__)),
    "accepted by position not a list": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1, [],
                                             [0] * len(StepStats.__slots__)),
    "accepted by position not ints": frame(PROTOCOL_VERSION, Kind.OUTPUTS, 1, [],
                                           [0] * (len(StepStats.__slots__) - 1) + [["1"]]),
}


@pytest.mark.parametrize("blob", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frames_raise_frame_error(blob):
    with pytest.raises(FrameError):
        decode(blob)


def test_oversized_frame_is_refused_before_unpacking():
    with pytest.raises(FrameError, match="exceeds"):
        decode(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_kv_blocks_come_with_their_payload_part_and_nothing_else_does() -> None:
    header = encode(KVBlocks("r1", "layout", [b"\x01" * 16, b"\x02" * 16]))
    assert decode_message(header, 2) == KVBlocks("r1", "layout", [b"\x01" * 16, b"\x02" * 16])
    with pytest.raises(FrameError, match="KVBlocks message of 1 parts"):
        decode_message(header, 1)
    with pytest.raises(FrameError, match="Shutdown message of 2 parts"):
        decode_message(encode(Shutdown()), 2)
    assert decode_message(encode(Shutdown()), 1) == Shutdown()
