"""The msgpack wire protocol between frontend and engine (see DESIGN.md).

Every frame is one msgpack array: [PROTOCOL_VERSION, kind, *fields]. Token ids
travel as little-endian int32 bytes. Decoding is strict: anything malformed,
unknown or oversized raises FrameError, which both sides log and drop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any, ClassVar

import msgpack

from common.sampling import SamplingParams
from common.wire_fields import FrameError, expect, pack_token_ids, unpack_token_ids

PROTOCOL_VERSION = 9
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_STRING_BYTES = 4 * 1024 * 1024  # one string field (a grammar is the largest)
MAX_TENANT_NAME_CHARS = 256


class Kind(IntEnum):
    ADD = 1
    ABORT = 2
    SHUTDOWN = 3
    KV_BLOCKS = 4  # either way: a prefill engine's KV, relayed to a decode engine
    READY = 10
    OUTPUTS = 11
    ERROR = 12


class FinishReason:
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    TIMEOUT = "timeout"  # the request's deadline passed while it ran: its output is partial


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0
    tenant: str = ""  # who sent it (frontend.tenants); "" : the one tenant without --tenants
    tenant_weight: float = 1.0  # the tenant's share of the engine, relative to the others'
    timeout_s: float | None = None  # seconds from reaching the engine to its deadline
    # Prefill/decode disaggregation (frontend.disaggregation). A prefill leg sends its prompt
    # blocks' KV out as KV_BLOCKS frames (`export_kv`), all but the first `kv_skip_blocks`
    # (its decode engine holds them); a decode leg continues after the tokens its prefill
    # leg generated (`output_token_ids`), their KV relayed beforehand.
    output_token_ids: list[int] = field(default_factory=list)
    export_kv: bool = False
    kv_skip_blocks: int = 0

    def fields(self) -> list[Any]:
        return [
            self.request_id,
            pack_token_ids(self.prompt_token_ids),
            self.sampling.to_wire(),
            self.arrival_time,
            self.priority,
            self.tenant,
            self.tenant_weight,
            self.timeout_s,
            pack_token_ids(self.output_token_ids),
            self.export_kv,
            self.kv_skip_blocks,
        ]

    @classmethod
    def from_fields(cls, request_id, prompt, sampling, arrival_time, priority, tenant,
                    tenant_weight, timeout_s, output_token_ids=b"", export_kv=False,
                    kv_skip_blocks=0) -> AddRequest:
        expect(request_id, str, "request_id")
        expect(arrival_time, float | int, "arrival_time")
        expect(priority, int, "priority")
        expect(tenant, str, "tenant")
        if len(tenant) > MAX_TENANT_NAME_CHARS:
            raise FrameError(f"tenant name longer than {MAX_TENANT_NAME_CHARS} characters")
        expect(tenant_weight, float | int, "tenant_weight")
        if not (math.isfinite(tenant_weight) and tenant_weight > 0):
            raise FrameError(f"tenant_weight must be positive and finite, not {tenant_weight}")
        if timeout_s is not None:
            expect(timeout_s, float | int, "timeout_s")
            if not (math.isfinite(timeout_s) and timeout_s > 0):
                raise FrameError(f"timeout_s must be positive and finite, not {timeout_s}")
        try:
            params = SamplingParams.from_wire(sampling)
        except (TypeError, ValueError) as exc:
            raise FrameError(f"bad sampling params: {exc}") from exc
        expect(export_kv, bool, "export_kv")
        expect(kv_skip_blocks, int, "kv_skip_blocks")
        if kv_skip_blocks < 0:
            raise FrameError(f"kv_skip_blocks must not be negative, not {kv_skip_blocks}")
        return cls(request_id, unpack_token_ids(prompt), params, float(arrival_time), priority,
                   tenant, float(tenant_weight),
                   None if timeout_s is None else float(timeout_s),
                   unpack_token_ids(output_token_ids), export_kv, kv_skip_blocks)


@dataclass(slots=True)
class AbortRequests:
    request_ids: list[str]

    def fields(self) -> list[Any]:
        return [self.request_ids]

    @classmethod
    def from_fields(cls, request_ids) -> AbortRequests:
        expect(request_ids, list, "request_ids")
        for request_id in request_ids:
            expect(request_id, str, "request_id")
        return cls(request_ids)


@dataclass(slots=True)
class Shutdown:
    def fields(self) -> list[Any]:
        return []

    @classmethod
    def from_fields(cls) -> Shutdown:
        return cls()


@dataclass(slots=True)
class Ready:
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    vocab_size: int
    priority_scheduling: bool = False  # requests' priorities order the waiting queue
    protocol_version: int = PROTOCOL_VERSION

    def fields(self) -> list[Any]:
        return [
            self.model_name,
            self.max_model_len,
            self.num_kv_blocks,
            self.block_size,
            self.eos_token_ids,
            self.vocab_size,
            self.priority_scheduling,
            self.protocol_version,
        ]

    @classmethod
    def from_fields(cls, model_name, max_model_len, num_kv_blocks, block_size, eos, vocab,
                    priority_scheduling, ver) -> Ready:
        expect(model_name, str, "model_name")
        for name, value in [("max_model_len", max_model_len), ("num_kv_blocks", num_kv_blocks),
                            ("block_size", block_size), ("vocab_size", vocab), ("version", ver)]:
            expect(value, int, name)
        expect(eos, list, "eos_token_ids")
        expect(priority_scheduling, bool, "priority_scheduling")
        return cls(model_name, max_model_len, num_kv_blocks, block_size, eos, vocab,
                   priority_scheduling, ver)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    # per new token: [chosen token logprob, [[top token id, logprob], ...]]
    logprobs: list[list[Any]] | None = None
    # On a request's first token only: seconds from reaching the engine to first being scheduled.
    queue_time_s: float | None = None
    # An embedding request's pooled vector, as little-endian float32 bytes (on its last output)
    embedding: bytes | None = None

    def to_wire(self) -> list[Any]:
        return [
            self.request_id,
            pack_token_ids(self.new_token_ids),
            self.finish_reason,
            self.num_cached_tokens,
            self.logprobs,
            self.queue_time_s,
            self.embedding,
        ]

    @classmethod
    def from_wire(cls, wire) -> RequestOutput:
        if not isinstance(wire, list) or len(wire) != 7:
            raise FrameError("request output must be a 7-element array")
        request_id, tokens, finish_reason, num_cached, logprobs, queue_time, embedding = wire
        expect(request_id, str, "request_id")
        expect(finish_reason, str | None, "finish_reason")
        expect(num_cached, int, "num_cached_tokens")
        expect(logprobs, list | None, "logprobs")
        if queue_time is not None:
            expect(queue_time, float | int, "queue_time_s")
        expect(embedding, bytes | None, "embedding")
        if embedding is not None and len(embedding) % 4:
            raise FrameError("embedding bytes are not float32 values")
        return cls(request_id, unpack_token_ids(tokens), finish_reason, num_cached, logprobs,
                   None if queue_time is None else float(queue_time), embedding)


@dataclass(slots=True)
class StepStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generation_tokens: int = 0  # tokens sampled this step
    step_time_s: float = 0.0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    kv_integrity_violations_total: int = 0  # from the check run whenever the engine idles
    at_rest: bool = False  # the going-idle report: the check above is current, no step runs
    bad_frames_total: int = 0  # frames the engine could not decode and dropped
    # The prefix cache's disk tier (engine.kv_offload): prompt tokens it supplied, bytes and
    # seconds of its reads and writes
    prefix_cache_disk_hits_total: int = 0
    kv_offload_read_bytes_total: int = 0
    kv_offload_written_bytes_total: int = 0
    kv_offload_read_seconds_total: float = 0.0
    kv_offload_write_seconds_total: float = 0.0
    # Prompt tokens whose KV a prefill engine handed over (engine.kv_transfer)
    prefix_cache_transfer_hits_total: int = 0
    # When this engine process started (time.time()): a new value means the totals above
    # count from zero again
    engine_start_time: float = 0.0
    # Speculative decoding (engine.speculative): verifications with drafts, draft tokens,
    # accepted ones, and accepted ones by draft position.
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_by_position_total: list[int] = field(default_factory=list)

    def to_wire(self) -> list[Any]:
        return [getattr(self, name) for name in self.__slots__]

    @classmethod
    def from_wire(cls, wire) -> StepStats:
        if not isinstance(wire, list) or len(wire) != len(cls.__slots__):
            raise FrameError("bad step stats")
        *scalars, by_position = wire
        for spec, value in zip(fields(cls), scalars, strict=False):  # a flag's default: bool
            expect(value, bool if isinstance(spec.default, bool) else int | float, spec.name)
        expect(by_position, list, "spec_decode_accepted_by_position_total")
        for value in by_position:
            expect(value, int, "spec_decode_accepted_by_position_total")
        return cls(*wire)


@dataclass(slots=True)
class StepOutputs:
    step: int
    outputs: list[RequestOutput]
    stats: StepStats = field(default_factory=StepStats)

    def fields(self) -> list[Any]:
        return [self.step, [output.to_wire() for output in self.outputs], self.stats.to_wire()]

    @classmethod
    def from_fields(cls, step, outputs, stats) -> StepOutputs:
        expect(step, int, "step")
        expect(outputs, list, "outputs")
        return cls(step, [RequestOutput.from_wire(o) for o in outputs], StepStats.from_wire(stats))


@dataclass(slots=True)
class RequestError:
    request_id: str
    reason: str
    code: str = ""  # "": refused or failed; DEADLINE_EXCEEDED: dropped unstarted at its deadline

    DEADLINE_EXCEEDED: ClassVar[str] = "deadline_exceeded"

    def fields(self) -> list[Any]:
        return [self.request_id, self.reason, self.code]

    @classmethod
    def from_fields(cls, request_id, reason, code) -> RequestError:
        expect(request_id, str, "request_id")
        expect(reason, str, "reason")
        expect(code, str, "code")
        return cls(request_id, reason, code)


@dataclass(slots=True)
class KVBlocks:
    """Whole KV blocks of one request's prompt, the header of a two-part ZeroMQ message
    whose second part is their payload: each block's K and V in every layer, in block order
    (engine.kv_transfer). `layout` names what a payload means (model, dtype, shapes): a
    receiver with another layout drops the frame. The payload part travels as is, so the
    frontend relays it without a copy."""

    request_id: str
    layout: str
    block_hashes: list[bytes]

    def fields(self) -> list[Any]:
        return [self.request_id, self.layout, self.block_hashes]

    @classmethod
    def from_fields(cls, request_id, layout, block_hashes) -> KVBlocks:
        expect(request_id, str, "request_id")
        expect(layout, str, "layout")
        expect(block_hashes, list, "block_hashes")
        for block_hash in block_hashes:
            expect(block_hash, bytes, "block_hash")
        return cls(request_id, layout, block_hashes)


Message = AddRequest | AbortRequests | Shutdown | Ready | StepOutputs | RequestError | KVBlocks

_KIND_OF: dict[type, Kind] = {
    AddRequest: Kind.ADD,
    AbortRequests: Kind.ABORT,
    Shutdown: Kind.SHUTDOWN,
    Ready: Kind.READY,
    StepOutputs: Kind.OUTPUTS,
    RequestError: Kind.ERROR,
    KVBlocks: Kind.KV_BLOCKS,
}
_TYPE_OF: dict[int, type] = {kind.value: cls for cls, kind in _KIND_OF.items()}


def encode(message: Message) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, _KIND_OF[type(message)].value, *message.fields()])


def decode(frame: bytes) -> Message:
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        unpacked = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=False,
            max_str_len=MAX_STRING_BYTES,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=1024 * 1024,
            max_map_len=64 * 1024,
        )
    except Exception as exc:  # msgpack raises many exception types on garbage
        raise FrameError(f"undecodable frame: {exc}") from exc
    if not isinstance(unpacked, list) or len(unpacked) < 2:
        raise FrameError("frame must be an array [version, kind, ...]")
    version, kind, *payload = unpacked
    if version != PROTOCOL_VERSION:
        raise FrameError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    message_type = _TYPE_OF.get(kind) if isinstance(kind, int) else None
    if message_type is None:
        raise FrameError(f"unknown message kind {kind!r}")
    try:
        return message_type.from_fields(*payload)
    except TypeError as exc:
        raise FrameError(f"wrong field count for {message_type.__name__}: {exc}") from exc


def decode_message(header: bytes, num_parts: int) -> Message:
    """A ZeroMQ message's first part decoded: KV_BLOCKS comes with its payload as a second
    part, every other message alone."""
    message = decode(header)
    if num_parts != (2 if isinstance(message, KVBlocks) else 1):
        raise FrameError(f"a {type(message).__name__} message of {num_parts} parts")
    return message


def refused_add_id(frame: bytes) -> str | None:
    """The request id of an ADD frame that `decode` refused (a field out of bounds, say), so
    the engine can answer with a RequestError instead of losing the request; None when the
    frame is no readable ADD. The frame's size is already bounded by MAX_FRAME_BYTES."""
    try:
        unpacked = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:  # garbage: nobody to answer
        return None
    if (isinstance(unpacked, list) and len(unpacked) > 2 and unpacked[1] == Kind.ADD
            and isinstance(unpacked[2], str) and len(unpacked[2]) <= 1024):
        return unpacked[2]
    return None
