"""Small decode steps on the CPU, replayed from kernel tapes (engine.executor.kernel_tape).

A decode step of n rows (n up to MAX_TAPE_BATCH, where the Python between kernels is a large
share of the step) runs over `StaticDecodeInputs` of its own: the step's ids, positions,
context lengths, block tables and KV write rows, staged at fixed addresses. The first step
of each size (and thread count: the kernels take it as an argument) runs the forward over
them twice, once to warm what it builds lazily and once recording; every later one stages
its inputs and replays the tape. A size whose recording is refused stays eager, logged once.
Only the C++ attention backend's decode path reads nothing but tensors, so only it is taped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend
from engine.attention.decode_buckets import DecodeBatch
from engine.attention.forward_context import forward_context
from engine.attention.metadata import AttentionMetadata, HeadPlan, StepPlan
from engine.executor.cuda_graphs import Forward, KVCaches
from engine.executor.kernel_tape import RecordingRefused, Tape, held_tensors, record
from engine.kv_cache_groups import blocks_for

logger = logging.getLogger(__name__)

MAX_TAPE_BATCH = 16


@dataclass(slots=True)
class StaticDecodeInputs:
    """One decode step of `size` rows at fixed addresses; tables, slots and write rows one
    per KV cache group."""

    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    lens: torch.Tensor  # [size] int64: tokens each row attends
    row_index: torch.Tensor  # [size] int64: row i of q is row i (constant)
    block_tables: list[torch.Tensor]  # [size, max blocks per sequence] int64
    slots: list[torch.Tensor]  # [size] int64
    write_rows: list[torch.Tensor]  # [size * kv heads] int64: each new (token, head)'s cache row
    block_size: int
    num_kv_heads: int

    @classmethod
    def allocate(cls, size: int, width: int, block_size: int, num_kv_heads: int,
                 num_groups: int) -> StaticDecodeInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64)

        return cls(zeros(size), zeros(size), torch.ones(size, dtype=torch.int64),
                   torch.arange(size, dtype=torch.int64),
                   [zeros(size, width) for _ in range(num_groups)],
                   [zeros(size) for _ in range(num_groups)],
                   [zeros(size * num_kv_heads) for _ in range(num_groups)],
                   block_size, num_kv_heads)

    @property
    def size(self) -> int:
        return self.input_ids.numel()

    @property
    def width(self) -> int:
        return self.block_tables[0].shape[1]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.lens, self.row_index, *self.block_tables,
                *self.slots, *self.write_rows]

    def stage(self, token_ids: list[int], positions: list[int], seq_lens: list[int],
              slot_mappings: list[list[int]], tables: list[list[list[int]]]) -> None:
        """The step's values into the buffers (through numpy views: list assignment there is
        several times cheaper than a tensor per list)."""
        self.input_ids.numpy()[:] = token_ids
        self.positions.numpy()[:] = positions
        self.lens.numpy()[:] = seq_lens
        heads = np.arange(self.num_kv_heads)
        for group_slots, group_tables, slots, block_tables, write_rows in zip(
                slot_mappings, tables, self.slots, self.block_tables, self.write_rows,
                strict=True):
            slots.numpy()[:] = group_slots
            table_rows = block_tables.numpy()
            for row, table in enumerate(group_tables):
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
                                tables, max_block=num_cache_blocks - 1)
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
    """Decode steps of up to MAX_TAPE_BATCH rows from tapes, recorded on each size's first
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
        self.taped: dict[tuple[int, int], Taped] = {}  # by (rows, threads)
        self.refused: set[int] = set()  # sizes whose recording was refused

    def serves(self, num_rows: int, table_width: int) -> bool:
        return (0 < num_rows <= self.max_batch and num_rows not in self.refused
                and table_width <= self.width)

    def run(self, token_ids: list[int], positions: list[int], seq_lens: list[int],
            slot_mappings: list[list[int]], tables: list[list[list[int]]],
            ) -> torch.Tensor | None:
        """Hidden states [rows, hidden] of the decode step (the tape's output buffer: read
        it before the next step), or None where its size's recording was refused just now
        (the caller runs it eagerly)."""
        key = (len(token_ids), torch.get_num_threads())
        taped = self.taped.get(key)
        if taped is not None:
            taped.inputs.stage(token_ids, positions, seq_lens, slot_mappings, tables)
            taped.tape.replay()
            return taped.output
        inputs = StaticDecodeInputs.allocate(len(token_ids), self.width, self.block_size,
                                             self.kv_caches[0][0].shape[1], self.num_groups)
        inputs.stage(token_ids, positions, seq_lens, slot_mappings, tables)
        taped = self._record(inputs)
        if taped is None:
            self.refused.add(len(token_ids))
            return None
        self.taped[key] = taped
        return taped.output

    def _record(self, inputs: StaticDecodeInputs) -> Taped | None:
        metadata = inputs.metadata(self.num_cache_blocks)

        def step() -> torch.Tensor:
            with forward_context(metadata, self.backend):
                return self.forward(inputs.input_ids, inputs.positions, self.kv_caches)

        started = time.perf_counter()
        step()  # builds what the forward makes once (kernels, cached tables) outside the tape
        trusted = [*held_tensors(self.model), *inputs.tensors,
                   *(cache for pair in self.kv_caches for cache in pair)]
        try:
            tape, output = record(step, trusted)
        except RecordingRefused as refusal:
            logger.warning("decode steps of %d rows stay eager: %s", inputs.size, refusal)
            return None
        logger.info("decode tape for %d rows (%d threads): %d calls, recorded in %.2f s",
                    inputs.size, torch.get_num_threads(), len(tape.calls),
                    time.perf_counter() - started)
        return Taped(inputs, tape, output)
