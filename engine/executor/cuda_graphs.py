"""CUDA graphs for decode steps.

On a GPU a decode step launches a few hundred small kernels from Python, and at small batches
the launches, not the GPU, set the pace. So each decode batch size up to the largest bucket is
rounded up to a bucket, one graph per bucket is recorded at start-up over persistent input
buffers, and each decode step copies its inputs into those buffers (pinned host memory,
non-blocking) and replays the bucket's graph. Padding rows decode token 0 at position 0 into a
reserved KV block that no request ever owns. Prefill and mixed steps, and decode batches above
the largest bucket, run eagerly; `--enforce-eager` turns graphs off.

Inside a graph, attention may read only tensors whose addresses never change: the recorded
step's metadata holds views of the persistent buffers and is marked `static`; the graphs run
the Triton backend (engine.attention.triton_backend), the one that reads no per-step Python
values.

A `Recorder` hides the one CUDA-only piece. `CudaGraphRecorder` records and replays real
graphs; `EagerReplay` (CPU tests, through Triton's interpreter) re-runs the recorded function
over the same buffers, which checks everything but the recording: bucket padding, the
reserved block, and that the buffers are the step's only inputs.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from common.config import EngineConfig
from engine.attention.forward_context import forward_context
from engine.attention.metadata import AttentionMetadata
from engine.attention.quantized_kv import is_quantized
from engine.attention.triton_backend import TritonBackend, triton_supports
from engine.attention.triton_kernels import QueryRows
from engine.kv_cache_groups import blocks_for

logger = logging.getLogger(__name__)

# Decode batch sizes that get a graph (capped at --max-num-seqs); others round up to the next.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
Forward = Callable[[torch.Tensor, torch.Tensor, KVCaches], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    return sorted({min(size, max_num_seqs) for size in GRAPH_BATCH_SIZES})


def bucket_for(sizes: list[int], batch: int) -> int:
    """The smallest recorded size that holds `batch` decodes (sizes ascending)."""
    if not 0 < batch <= sizes[-1]:
        raise ValueError(f"no decode graph holds {batch} rows (largest: {sizes[-1]})")
    return sizes[bisect.bisect_left(sizes, batch)]


@dataclass(slots=True)
class Recorded:
    replay: Callable[[], None]
    output: torch.Tensor  # where each replay leaves the step's hidden states


class Recorder(Protocol):
    def record(self, step: Callable[[], torch.Tensor]) -> Recorded: ...


class CudaGraphRecorder:
    """Real CUDA graphs sharing one memory pool, recorded from the largest batch down."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, step: Callable[[], torch.Tensor]) -> Recorded:
        # One eager run first, on a side stream, as torch.cuda.graph requires: it compiles
        # the Triton kernels and sets up cuBLAS workspaces outside the recording.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        return Recorded(graph.replay, output)


class EagerReplay:
    """Replays by running the step again over the same buffers (CPU tests)."""

    def record(self, step: Callable[[], torch.Tensor]) -> Recorded:
        output = step()
        return Recorded(lambda: output.copy_(step()), output)


@dataclass(slots=True)
class StagedBuffer:
    """A persistent device tensor and its pinned host twin (the same tensor on the CPU)."""

    device: torch.Tensor
    host: torch.Tensor

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> StagedBuffer:
        on_device = torch.zeros(shape, dtype=dtype, device=device)
        if device.type == "cpu":
            return cls(on_device, on_device)
        return cls(on_device, torch.zeros(shape, dtype=dtype, pin_memory=True))

    def upload(self, rows: int, columns: int | None = None) -> None:
        """Copies the first `rows` (and `columns`) to the device without waiting (the host
        side must not change until the copy is done: see DecodeInputs.stage)."""
        if self.host is self.device:
            return
        if columns is None:
            self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        else:
            self.device[:rows, :columns].copy_(self.host[:rows, :columns], non_blocking=True)


@dataclass(slots=True)
class DecodeInputs:
    """A decode step's inputs, padded to the largest bucket, at fixed addresses; slot
    mappings and block tables one per KV cache group (engine.kv_cache_groups)."""

    input_ids: StagedBuffer  # [capacity] int64
    positions: StagedBuffer  # [capacity] int64
    context_lens: StagedBuffer  # [capacity] int32: tokens each row attends (its seq len)
    slot_mappings: list[StagedBuffer]  # per group: [capacity] int64
    block_tables: list[StagedBuffer]  # per group: [capacity, max blocks per sequence] int64
    rows: torch.Tensor  # [capacity] int32: row i reads block-table row i (constant)
    padding_block: int  # the KV block no request owns
    block_size: int
    uploaded: torch.cuda.Event | None = None  # the last stage's copies, on a GPU

    @classmethod
    def allocate(cls, capacity: int, width: int, padding_block: int, block_size: int,
                 device: torch.device, num_groups: int = 1) -> DecodeInputs:
        inputs = cls(
            *(StagedBuffer.allocate((capacity,), torch.int64, device) for _ in range(2)),
            StagedBuffer.allocate((capacity,), torch.int32, device),
            [StagedBuffer.allocate((capacity,), torch.int64, device) for _ in range(num_groups)],
            [StagedBuffer.allocate((capacity, width), torch.int64, device)
             for _ in range(num_groups)],
            torch.arange(capacity, dtype=torch.int32, device=device),
            padding_block,
            block_size,
        )
        inputs.stage([], [], [[]] * num_groups, [], [[]] * num_groups, capacity)
        return inputs  # recording runs on padding rows only

    @property
    def capacity(self) -> int:
        return self.rows.numel()

    @property
    def width(self) -> int:
        return self.block_tables[0].host.shape[1]

    def stage(self, token_ids: list[int], positions: list[int], slot_mappings: list[list[int]],
              seq_lens: list[int], tables: list[list[list[int]]], size: int) -> None:
        """The first `size` rows: the step's decodes, then padding rows, which decode token 0
        at position 0 of the padding block. (numpy views: list assignment there is several
        times cheaper than a torch.tensor per list.)"""
        if self.uploaded is not None:
            # Normally long done: a step's sampled ids coming back waited for its copies.
            self.uploaded.synchronize()
        n = len(token_ids)
        pad = self.padding_block
        for buffer, values, filler in (
                (self.input_ids, token_ids, 0), (self.positions, positions, 0),
                (self.context_lens, seq_lens, 1),
                *((buffer, slots, pad * self.block_size)
                  for buffer, slots in zip(self.slot_mappings, slot_mappings, strict=True))):
            host = buffer.host.numpy()
            host[:n] = values
            host[n:size] = filler
            buffer.upload(size)
        for buffer, group_tables in zip(self.block_tables, tables, strict=True):
            host_tables = buffer.host.numpy()
            for row, table in enumerate(group_tables):  # ragged: one slice assignment per row
                host_tables[row, :len(table)] = table
            host_tables[n:size, 0] = pad  # a padding row reads its one token from there
            buffer.upload(size, max(map(len, group_tables), default=1))
        if self.rows.is_cuda:
            self.uploaded = torch.cuda.Event()
            self.uploaded.record()

    def metadata(self, size: int) -> list[AttentionMetadata]:
        """What attention reads inside a graph of `size` rows, per group: views of the
        buffers only."""
        rows = QueryRows(self.rows[:size], self.context_lens.device[:size])
        return [AttentionMetadata(
            query_start_loc=list(range(size + 1)),
            seq_lens=[],  # per step, so never read: the Triton backend reads no list
            block_tables=tables.device[:size],
            slot_mapping=slots.device[:size],
            triton_rows=rows,
            static=True,
        ) for tables, slots in zip(self.block_tables, self.slot_mappings, strict=True)]


class DecodeGraphs:
    """One recorded decode step per bucket of batch sizes, over one set of DecodeInputs."""

    def __init__(self, forward: Forward, kv_caches: KVCaches, block_size: int,
                 max_model_len: int, max_num_seqs: int, padding_block: int,
                 device: torch.device, recorder: Recorder, num_groups: int = 1) -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        # Recorded steps read only the buffers' views, which the Triton backend alone takes.
        self.attention = TritonBackend(block_size, kv_caches[0][0].shape[1])
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.inputs = DecodeInputs.allocate(self.sizes[-1], blocks_for(max_model_len, block_size),
                                            padding_block, block_size, device, num_groups)
        started = time.perf_counter()
        self.graphs: dict[int, Recorded] = {}
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the rest reuse its memory
                self.graphs[size] = recorder.record(self._step(size))
        logger.info("decode graphs for batch sizes %s recorded in %.1f s", self.sizes,
                    time.perf_counter() - started)

    def serves(self, batch: int, table_width: int) -> bool:
        return batch <= self.sizes[-1] and table_width <= self.inputs.width

    def _step(self, size: int) -> Callable[[], torch.Tensor]:
        """The decode step of `size` rows, its metadata and input views made once, as a
        recording fixes them."""
        metadata = self.inputs.metadata(size)
        input_ids = self.inputs.input_ids.device[:size]
        positions = self.inputs.positions.device[:size]

        def step() -> torch.Tensor:
            with forward_context(metadata, self.attention):
                return self.forward(input_ids, positions, self.kv_caches)

        return step

    def run(self, token_ids: list[int], positions: list[int], slot_mappings: list[list[int]],
            seq_lens: list[int], tables: list[list[list[int]]]) -> torch.Tensor:
        """Hidden states [len(token_ids), hidden] of one decode step (a view of the graph's
        output: read it before the next replay)."""
        size = bucket_for(self.sizes, len(token_ids))
        self.inputs.stage(token_ids, positions, slot_mappings, seq_lens, tables, size)
        recorded = self.graphs[size]
        recorded.replay()
        return recorded.output[:len(token_ids)]


def default_recorder(device: torch.device, config: EngineConfig, head_dim: int,
                     cache_dtype: torch.dtype | None = None) -> Recorder | None:
    """CUDA graphs where the GPU path's attention (Triton) serves the model's shapes and
    its KV cache (not an 8-bit one)."""
    if device.type != "cuda" or config.enforce_eager:
        return None
    if cache_dtype is not None and is_quantized(cache_dtype):
        logger.warning("no CUDA graphs with an 8-bit KV cache: its attention runs torch ops")
        return None
    if config.tensor_parallel_size > 1:
        logger.warning("no CUDA graphs with tensor parallelism yet: decode steps run eager")
        return None
    if not triton_supports(head_dim, config.block_size):
        logger.warning("no CUDA graphs: they need triton and power-of-two head dim and "
                       "block size")
        return None
    return CudaGraphRecorder(device)


def graph_memory(record_probe: Callable[[], object], device: torch.device) -> int:
    """Bytes the decode graphs keep on the GPU: measured by recording them once over a
    one-block cache (`record_probe` builds a runner that does), before the real cache is
    sized, and released again."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    probe = record_probe()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_reserved(device) - before
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    logger.info("decode graphs hold %.0f MiB, kept out of the KV cache", held / 2**20)
    return held
