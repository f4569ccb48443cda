"""Small decode steps on the CPU, replayed from kernel tapes (engine.executor.kernel_tape).

A step of n decode rows (n up to MAX_TAPE_BATCH, where the Python between kernels is a large
share of the step) runs over `StaticDecodeInputs` of its own: the step's ids, positions,
context lengths, block tables and KV write rows, staged at fixed addresses. A speculative
step's drafted decodes are decode rows too, each over its causal prefix, a request's rows
read together as one run (engine.attention.metadata.plan_rows): such a step's shape is its
rows and its requests. The first step of each shape (and thread count: the kernels take it
as an argument) runs the forward over them twice, once to warm what it builds lazily and
once recording; every later one stages its inputs and replays the tape. The plain decode
shapes are recorded when the engine starts (`record_decodes`), and with speculative decoding
one request's drafted ones (`record_drafted`). A shape whose
recording is refused stays eager, logged once. Only the C++ attention backend's decode path
reads nothing but tensors, so only it is taped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend
from engine.attention.decode_buckets import DecodeBatch
from engine.attention.forward_context import forward_context
from engine.attention.metadata import AttentionMetadata, HeadPlan, StepPlan, run_offsets
from engine.executor.cuda_graphs import Forward, KVCaches
from engine.executor.kernel_tape import RecordingRefused, Tape, held_tensors, record
from engine.kv_cache_groups import blocks_for
from engine.platform.lifelong import lifelong_tensors

logger = logging.getLogger(__name__)

MAX_TAPE_BATCH = 16


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a tape is recorded for: the step's rows, its requests (fewer where some carry
    drafts) and the kernels' thread count."""

    rows: int
    requests: int
    threads: int

    @property
    def has_runs(self) -> bool:
        return self.rows > self.requests


@dataclass(slots=True)
class StaticDecodeInputs:
    """One step of `size` decode rows at fixed addresses; tables, slots and write rows one
    per KV cache group; `runs` where a request has several rows (its drafts)."""

    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    lens: torch.Tensor  # [size] int64: tokens each row attends
    row_index: torch.Tensor  # [size] int64: row i of q is row i (constant)
    block_tables: list[torch.Tensor]  # [size, max blocks per sequence] int64: each row's
    slots: list[torch.Tensor]  # [size] int64
    write_rows: list[torch.Tensor]  # [size * kv heads] int64: each new (token, head)'s cache row
    runs: torch.Tensor | None  # [requests + 1] int64: request i's rows are runs[i]..runs[i+1]
    block_size: int
    num_kv_heads: int

    @classmethod
    def allocate(cls, shape: StepShape, width: int, block_size: int, num_kv_heads: int,
                 num_groups: int) -> StaticDecodeInputs:
        def zeros(*dims: int) -> torch.Tensor:
            return torch.zeros(dims, dtype=torch.int64)

        size = shape.rows
        return cls(zeros(size), zeros(size), torch.ones(size, dtype=torch.int64),
                   torch.arange(size, dtype=torch.int64),
                   [zeros(size, width) for _ in range(num_groups)],
                   [zeros(size) for _ in range(num_groups)],
                   [zeros(size * num_kv_heads) for _ in range(num_groups)],
                   zeros(shape.requests + 1) if shape.has_runs else None,
                   block_size, num_kv_heads)

    @property
    def size(self) -> int:
        return self.input_ids.numel()

    @property
    def num_requests(self) -> int:
        return self.size if self.runs is None else self.runs.numel() - 1

    @property
    def width(self) -> int:
        return self.block_tables[0].shape[1]

    @property
    def tensors(self) -> list[torch.Tensor]:
        runs = [] if self.runs is None else [self.runs]
        return [self.input_ids, self.positions, self.lens, self.row_index, *self.block_tables,
                *self.slots, *self.write_rows, *runs]

    def stage(self, token_ids: list[int], positions: list[int], query_lens: list[int],
              slot_mappings: list[list[int]], tables: list[list[list[int]]]) -> None:
        """The step's values into the buffers (through numpy views: list assignment there is
        several times cheaper than a tensor per list). Request i has `query_lens[i]` rows
        at consecutive positions; each row attends its position's causal prefix."""
        self.input_ids.numpy()[:] = token_ids
        position_rows = self.positions.numpy()
        position_rows[:] = positions
        np.add(position_rows, 1, out=self.lens.numpy())
        owners = range(len(query_lens))
        if self.runs is not None:
            owners = np.repeat(owners, query_lens).tolist()
            self.runs.numpy()[:] = run_offsets(owners)
        heads = np.arange(self.num_kv_heads)
        for group_slots, group_tables, slots, block_tables, write_rows in zip(
                slot_mappings, tables, self.slots, self.block_tables, self.write_rows,
                strict=True):
            slots.numpy()[:] = group_slots
            table_rows = block_tables.numpy()
            for row, owner in enumerate(owners):
                table = group_tables[owner]
                table_rows[row, :len(table)] = table
            blocks, offsets = np.divmod(slots.numpy(), self.block_size)
            rows = (blocks[:, None] * self.num_kv_heads + heads) * self.block_size
            write_rows.numpy()[:] = (rows + offsets[:, None]).ravel()

    def metadata(self, num_cache_blocks: int) -> list[AttentionMetadata]:
        """What the C++ backend's decode path reads, per group: the buffers only (the lists
        are the recording's and never read on that path)."""
        size = self.size
        metadata = []
        for tables, slots, write_rows in zip(self.block_tables, self.slots, self.write_rows,
                                             strict=True):
            batch = DecodeBatch(list(range(size)), [1] * size, self.row_index, self.lens,
                                tables, max_block=num_cache_blocks - 1, runs=self.runs)
            head_plan = HeadPlan(write_rows, num_cache_blocks * self.num_kv_heads
                                 * self.block_size - 1, self.row_index[:0], [], [])
            metadata.append(AttentionMetadata(
                query_start_loc=list(range(size + 1)), seq_lens=[1] * size,
                block_tables=tables, slot_mapping=slots,
                plan=StepPlan(self.block_size, batch, [], kernel_rows=batch),
                head_plans={self.num_kv_heads: head_plan}, static=True))
        return metadata


@dataclass(slots=True)
class Taped:
    inputs: StaticDecodeInputs
    tape: Tape
    output: torch.Tensor  # where each replay leaves the step's hidden states


class DecodeTapes:
    """Steps of up to MAX_TAPE_BATCH decode rows from tapes, recorded on each shape's first
    step."""

    def __init__(self, model: torch.nn.Module, forward: Forward, kv_caches: KVCaches,
                 backend: AttentionBackend, block_size: int, max_model_len: int,
                 num_groups: int, max_batch: int = MAX_TAPE_BATCH) -> None:
        self.model = model
        self.forward = forward
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.width = blocks_for(max_model_len, block_size)
        self.num_groups = num_groups
        self.max_batch = max_batch
        self.num_cache_blocks = kv_caches[0][0].shape[0]
        self.taped: dict[StepShape, Taped] = {}
        self.refused: set[tuple[int, int]] = set()  # (rows, requests) whose recording was refused
        self.num_recorded = 0  # recordings tried: each took its step many times a replay's time

    def record_decodes(self) -> None:
        """Records the tapes of plain decode steps (1 to max_batch rows, one a request) now,
        over block 0 at position 0 (free before any request), so no request's step pays for
        a recording later. Drafted steps' shapes are recorded on first use (one request's
        at the start too: `record_drafted`)."""
        for rows in range(1, self.max_batch + 1):
            self.run([0] * rows, [0] * rows, [1] * rows, [[0] * rows] * self.num_groups,
                     [[[0]] * rows] * self.num_groups)

    def record_drafted(self, max_drafts: int) -> None:
        """Records the tapes of one request's drafted steps (its token and 1 to max_drafts
        drafts) now, over block 0: one stream meets each of them within its first requests,
        and a step that records costs ~30 replays."""
        for rows in range(2, min(max_drafts + 1, self.max_batch) + 1):
            blocks = [0] * blocks_for(rows, self.block_size)
            self.run([0] * rows, list(range(rows)), [rows], [[0] * rows] * self.num_groups,
                     [[blocks]] * self.num_groups)

    def serves(self, num_rows: int, num_requests: int, table_width: int) -> bool:
        return (0 < num_rows <= self.max_batch and (num_rows, num_requests) not in self.refused
                and table_width <= self.width)

    def run(self, token_ids: list[int], positions: list[int], query_lens: list[int],
            slot_mappings: list[list[int]], tables: list[list[list[int]]],
            give_way: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """Hidden states [rows, hidden] of the step (the tape's output buffer: read it
        before the next step), or None where its shape's recording was refused just now
        (the caller runs it eagerly). A replay stops where `give_way` says so (Tape.replay)."""
        shape = StepShape(len(token_ids), len(query_lens), torch.get_num_threads())
        taped = self.taped.get(shape)
        if taped is not None:
            taped.inputs.stage(token_ids, positions, query_lens, slot_mappings, tables)
            taped.tape.replay(give_way)
            return taped.output
        inputs = StaticDecodeInputs.allocate(shape, self.width, self.block_size,
                                             self.kv_caches[0][0].shape[1], self.num_groups)
        inputs.stage(token_ids, positions, query_lens, slot_mappings, tables)
        taped = self._record(inputs)
        self.num_recorded += 1
        if taped is None:
            self.refused.add((shape.rows, shape.requests))
            return None
        self.taped[shape] = taped
        return taped.output

    def _record(self, inputs: StaticDecodeInputs) -> Taped | None:
        metadata = inputs.metadata(self.num_cache_blocks)

        def step() -> torch.Tensor:
            with forward_context(metadata, self.backend):
                return self.forward(inputs.input_ids, inputs.positions, self.kv_caches)

        started = time.perf_counter()
        step()  # builds what the forward makes once (kernels, cached tables) outside the tape
        trusted = [*held_tensors(self.model), *inputs.tensors, *lifelong_tensors(),
                   *(cache for pair in self.kv_caches for cache in pair)]
        try:
            tape, output = record(step, trusted)
        except RecordingRefused as refusal:
            logger.warning("decode steps of %d rows (%d requests) stay eager: %s", inputs.size,
                           inputs.num_requests, refusal)
            return None
        logger.info("decode tape for %d rows of %d requests (%d threads): %d calls, recorded "
                    "in %.2f s", inputs.size, inputs.num_requests, torch.get_num_threads(),
                    len(tape.calls), time.perf_counter() - started)
        return Taped(inputs, tape, output)
