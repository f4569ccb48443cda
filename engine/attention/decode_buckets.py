"""The torch path's decode buckets: a step's decodes sorted by context length and split into
at most MAX_DECODE_BUCKETS groups, each padded to its longest context's blocks (one SDPA or
matmul call a bucket), as many buckets as the padding they save pays for."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.kv_cache_groups import blocks_for
from engine.platform.host_copy import int_tensor

# Decode buckets (torch path): requests sorted by context length and padded per bucket.
MAX_DECODE_BUCKETS = 4
# The cost of one more bucket (a few more small kernels) in units of one request-block of
# gathered K/V; it decides how many buckets pay off.
BUCKET_OVERHEAD_BLOCKS = 96


@dataclass(slots=True)
class DecodeBucket:
    """Decodes with similar context lengths, padded to one number of blocks (torch path)."""

    rows: torch.Tensor  # [n] int64: rows of q served by this bucket
    row_range: tuple[int, int] | None  # the same rows when they are one ascending run
    block_ids: torch.Tensor  # [n, num_blocks] int64, padded with block 0
    visible: torch.Tensor  # [n, 1, 1, num_blocks * block_size] bool: key inside the context
    biases: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive masks
    window_biases: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.rows.numel()

    @property
    def num_blocks(self) -> int:
        return self.block_ids.shape[1]


@dataclass(slots=True)
class DecodeBatch:
    """Every request with a single new token; it attends its whole context."""

    rows: list[int]  # their rows of q
    seq_lens: list[int]
    row_index: torch.Tensor  # [n] int64, the rows on device
    lens: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [n, max_blocks] int64 (rows may be strided)
    max_block: int  # the largest block id in their tables
    buckets: list[DecodeBucket] | None = None  # torch path, planned with the step (decode_buckets)
    # [num_runs + 1] int64 offsets: rows [runs[i], runs[i + 1]) are one request's at
    # consecutive positions, read over its blocks together (None: each row alone)
    runs: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def num_runs(self) -> int:
        return self.size if self.runs is None else self.runs.numel() - 1


def decode_buckets(batch: DecodeBatch, block_size: int) -> list[DecodeBucket]:
    if batch.buckets is None:
        batch.buckets = plan_decode_buckets(batch, block_size)
    return batch.buckets


def plan_decode_buckets(batch: DecodeBatch, block_size: int) -> list[DecodeBucket]:
    order = sorted(range(batch.size), key=batch.seq_lens.__getitem__)
    sorted_blocks = [blocks_for(batch.seq_lens[j], block_size) for j in order]
    bounds = choose_bucket_bounds(sorted_blocks, MAX_DECODE_BUCKETS)
    if len(bounds) == 2:
        order = list(range(batch.size))  # one bucket: keep the runner's order
    return [make_decode_bucket(batch, order[lo:hi], block_size)
            for lo, hi in itertools.pairwise(bounds) if hi > lo]


def choose_bucket_bounds(sorted_blocks: list[int], max_buckets: int) -> list[int]:
    """Equal-count split points into ascending block counts minimising padding + overhead."""
    n = len(sorted_blocks)
    best_cost, best_bounds = None, [0, n]
    for k in range(1, min(max_buckets, n) + 1):
        bounds = [round(j * n / k) for j in range(k + 1)]
        padded = sum((hi - lo) * sorted_blocks[hi - 1]
                     for lo, hi in itertools.pairwise(bounds) if hi > lo)
        cost = padded + k * BUCKET_OVERHEAD_BLOCKS
        if best_cost is None or cost < best_cost:
            best_cost, best_bounds = cost, bounds
    return best_bounds


def make_decode_bucket(batch: DecodeBatch, members: list[int], block_size: int) -> DecodeBucket:
    """A bucket of the batch's decodes `members` (indices into the batch)."""
    device = batch.row_index.device
    rows = [batch.rows[j] for j in members]
    num_blocks = max(blocks_for(batch.seq_lens[j], block_size) for j in members)
    if members == list(range(members[0], members[0] + len(members))):
        picked = slice(members[0], members[0] + len(members))
        block_ids, lens = batch.block_tables[picked], batch.lens[picked]
    else:
        index = int_tensor(members, device)
        block_ids, lens = batch.block_tables[index], batch.lens[index]
    visible = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]
    is_run = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeBucket(
        rows=int_tensor(rows, device),
        row_range=(rows[0], rows[0] + len(rows)) if is_run else None,
        block_ids=block_ids[:, :num_blocks].contiguous(),
        visible=visible[:, None, None, :],
    )
