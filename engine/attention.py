"""Paged attention: the ONE function boundary between the model and the KV cache layout.

The KV cache of one layer is a pair of tensors shaped
[num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a block).
Every step the model runner builds one AttentionMetadata for the flattened
variable-length batch (`AttentionMetadata.build`); each layer calls
`paged_attention`, which writes the step's new K/V through the slot mapping and
attends each request's queries over its whole context (cached blocks + the new
tokens, causally).

Everything derivable from the metadata alone (decode/prefill split, gather
indices, masks) is planned once per step and shared by all layers. Where the
small C++ kernel is enabled and compiles, it reads the paged cache in place for
every request with one new token ("decodes") and for every row of the prefill
chunks up to KERNEL_PREFILL_MAX_TOKENS, each row a decode over its own causal
prefix. Otherwise decodes take one gather into a reused buffer with the query
heads of each KV head folded into one attention call, and prefill chunks use
SDPA's fused causal kernel, with a causal-offset mask when they sit on cached
tokens. The torch decode path reads
padding slots past a request's context and masks them out, so the caches must
hold finite values everywhere: allocate them with `torch.zeros`.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from engine.cpu_decode_kernel import (
    kernel_supports,
    load_cpp_decode,
    load_cpp_library,
    run_paged_decode,
    run_write_kv,
)
from engine.cpu_elementwise_kernel import rows_of_contiguous_heads
from engine.forward_context import current_metadata
from engine.host_copy import device_tensor, int_tensor
from engine.linear import native_bf16_matmul
from engine.triton_attention import QueryRows
from engine.triton_attention import paged_attention as triton_attention
from engine.triton_attention import write_kv as triton_write_kv

logger = logging.getLogger(__name__)

# Decode buckets (torch path): requests sorted by context length and padded per bucket.
MAX_DECODE_BUCKETS = 4
# The cost of one more bucket (a few more small kernels) in units of one request-block of
# gathered K/V; it decides how many buckets pay off.
BUCKET_OVERHEAD_BLOCKS = 96
# How a decode bucket is computed on the torch path: "auto" takes explicit matmuls where the
# CPU has native GEMMs for the dtype (fp32; bf16 with AVX512-BF16/AMX), else SDPA's kernel.
DECODE_KERNEL: Literal["auto", "matmul", "sdpa"] = "auto"
# The C++ paged-decode kernel (CPU, fp32/bf16); LOOM_CPP_DECODE=0 turns it off.
CPP_DECODE = os.environ.get("LOOM_CPP_DECODE", "1") != "0"
# Prefill chunks up to this many tokens go through that kernel too, each query row as a decode
# over its own causal prefix: no masked rectangle on cached tokens, and on 2 cores several
# times faster than one SDPA call per short prompt. Longer fresh chunks keep SDPA's kernel.
KERNEL_PREFILL_MAX_TOKENS = 512
# On CUDA with triton installed, one Triton launch per layer writes the KV and one attends
# (engine.triton_attention); LOOM_TRITON_ATTENTION=0 keeps the torch path there.
TRITON_ATTENTION = os.environ.get("LOOM_TRITON_ATTENTION", "1") != "0"


class Workspace:
    """Grow-only scratch buffers reused across layers and steps.

    Large temporaries get fresh pages from the OS on every allocation, so the
    gathered K/V live in persistent flat buffers handed out as views.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]


DEFAULT_WORKSPACE = Workspace()


@dataclass(slots=True)
class DecodeBucket:
    """Decodes with similar context lengths, padded to one number of blocks (torch path)."""

    rows: torch.Tensor  # [n] int64: rows of q served by this bucket
    row_range: tuple[int, int] | None  # the same rows when they are one ascending run
    block_ids: torch.Tensor  # [n, num_blocks] int64, padded with block 0
    visible: torch.Tensor  # [n, 1, 1, num_blocks * block_size] bool: key inside the context
    biases: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive masks

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
    buckets: list[DecodeBucket] | None = None  # torch path, planned on first use

    @property
    def size(self) -> int:
        return len(self.rows)


@dataclass(slots=True)
class PrefillChunk:
    """A request with several new tokens; on cached tokens it reads its blocks under a mask."""

    request: int  # its index in the metadata
    start: int  # its queries are rows [start, end) of q
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [num_blocks] int64 when it sits on cached tokens
    mask: torch.Tensor | None  # [query_len, seq_len] bool: key j visible to query i
    biases: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive masks

    @property
    def has_cached_prefix(self) -> bool:
        return self.block_ids is not None


@dataclass(slots=True)
class StepPlan:
    """Everything derivable from the metadata alone, shared by every layer of a step."""

    block_size: int
    decodes: DecodeBatch | None
    prefills: list[PrefillChunk]
    # The C++ kernel's rows: every decode, then every row of the short prefill chunks
    kernel_rows: DecodeBatch | None = None
    kernel_prefills: frozenset[int] = frozenset()  # requests whose chunk is among them

    def kernel_covers(self, chunk: PrefillChunk) -> bool:
        return chunk.request in self.kernel_prefills


@dataclass(slots=True)
class HeadPlan:
    """The step plan expanded for one number of KV heads: row indices into the caches."""

    write_rows: torch.Tensor  # [T * num_kv_heads]: cache row of each new (token, head)
    max_write_row: int  # the largest of them (-1 when none): one bounds check per step
    gather_rows: torch.Tensor  # [R]: (block, head) rows to gather, all segments in order
    decode_starts: list[int]  # gather-buffer row offset of each decode bucket
    prefill_starts: list[int]  # ... of each prefill chunk on a cached prefix


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: list[int]  # [B + 1]: request i's queries are rows [s_i, s_{i+1}) of q
    seq_lens: list[int]  # [B]: context length of request i after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int64 on device, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 on device: block_id * block_size + offset per new token
    plan: StepPlan | None = None  # made by the first layer that needs it (`step_plan`)
    workspace: Workspace = field(default_factory=lambda: DEFAULT_WORKSPACE)
    head_plans: dict[tuple[int, bool], HeadPlan] = field(default_factory=dict)
    triton_rows: QueryRows | None = None  # the Triton kernels' per-row view, made once a step
    # Recorded into a CUDA graph (engine.cuda_graphs): only the tensors above are the step's,
    # the lists are the recording's, so attention takes the Triton path, which reads no list.
    static: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        starts = self.query_start_loc
        return [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]

    @property
    def num_decodes(self) -> int:
        return self.query_lens.count(1)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device | str,
        workspace: Workspace | None = None,
    ) -> AttentionMetadata:
        """One step's metadata. The plan every layer reuses is made by the first layer that
        needs it (the Triton path needs none: planning would only cost it device syncs)."""
        for table, seq_len in zip(block_tables, seq_lens, strict=True):
            if len(table) * block_size < seq_len:
                raise ValueError(f"a block table of {len(table)} blocks for {seq_len} tokens")
        device = torch.device(device)
        width = max(map(len, block_tables), default=0)
        padded = itertools.chain.from_iterable(
            itertools.chain(table, itertools.repeat(0, width - len(table)))
            for table in block_tables)
        metadata = cls(
            query_start_loc=[0, *itertools.accumulate(query_lens)],
            seq_lens=list(seq_lens),
            block_tables=int_tensor(padded, device).view(len(block_tables), width),
            slot_mapping=int_tensor(slot_mapping, device),
            workspace=workspace or DEFAULT_WORKSPACE,
        )
        return metadata

    def step_plan(self, block_size: int) -> StepPlan:
        if self.static:
            raise RuntimeError("a graph-recorded step has no plan: its lists are not the step's")
        if self.plan is None:
            self.plan = plan_step(self, block_size)
        if self.plan.block_size != block_size:
            raise ValueError(f"metadata planned for blocks of {self.plan.block_size} tokens, "
                             f"the cache has {block_size}")
        return self.plan

    def head_plan(self, num_kv_heads: int, block_size: int, kernel: bool) -> HeadPlan:
        """`kernel`: the C++ kernel serves the plan's kernel rows, which need no gathering."""
        key = (num_kv_heads, kernel)
        if key not in self.head_plans:
            plan = self.step_plan(block_size)
            self.head_plans[key] = expand_for_heads(plan, self.slot_mapping, num_kv_heads,
                                                    kernel)
        return self.head_plans[key]


# ---------------------------------------------------------------- planning, once per step


def blocks_for(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def plan_step(metadata: AttentionMetadata, block_size: int) -> StepPlan:
    query_lens = metadata.query_lens
    if metadata.block_tables.shape[1] * block_size < max(metadata.seq_lens, default=0):
        raise ValueError("block tables are narrower than the longest context")
    decode_ids = [i for i, query_len in enumerate(query_lens) if query_len == 1]
    prefill_ids = [i for i, query_len in enumerate(query_lens) if query_len > 1]
    prefills = [plan_prefill(metadata, i, block_size) for i in prefill_ids]
    decodes = plan_decodes(metadata, decode_ids) if decode_ids else None
    short = [i for i in prefill_ids if query_lens[i] <= KERNEL_PREFILL_MAX_TOKENS]
    kernel_rows = decodes
    if short:
        kernel_rows = plan_rows(metadata, decode_ids + short)
    return StepPlan(block_size, decodes, prefills, kernel_rows, frozenset(short))


def plan_decodes(metadata: AttentionMetadata, ids: list[int]) -> DecodeBatch:
    device = metadata.block_tables.device
    if ids == list(range(len(ids))):  # the runner's order: decodes first
        block_tables = metadata.block_tables[:len(ids)]
    else:
        block_tables = metadata.block_tables[int_tensor(ids, device)]
    rows = [metadata.query_start_loc[i] for i in ids]
    seq_lens = [metadata.seq_lens[i] for i in ids]
    return DecodeBatch(rows, seq_lens, int_tensor(rows, device), int_tensor(seq_lens, device),
                       block_tables, int(block_tables.max()))


def plan_rows(metadata: AttentionMetadata, ids: list[int]) -> DecodeBatch:
    """Every query row of the requests `ids`, each as a decode over its causal prefix."""
    device = metadata.block_tables.device
    rows, seq_lens, owners = causal_rows(metadata, ids)
    block_tables = metadata.block_tables.index_select(0, int_tensor(owners, device))
    return DecodeBatch(rows, seq_lens, int_tensor(rows, device), int_tensor(seq_lens, device),
                       block_tables, int(block_tables.max()))


def causal_rows(metadata: AttentionMetadata, ids: Iterable[int],
                ) -> tuple[list[int], list[int], list[int]]:
    """Every query row of the requests `ids` as a decode over its causal prefix: (its row
    of q, how many tokens it sees, its request)."""
    rows: list[int] = []
    seq_lens: list[int] = []
    owners: list[int] = []
    for i in ids:
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        first_len = metadata.seq_lens[i] - (end - start) + 1
        rows.extend(range(start, end))
        seq_lens.extend(range(first_len, first_len + end - start))
        owners.extend(itertools.repeat(i, end - start))
    return rows, seq_lens, owners


def plan_prefill(metadata: AttentionMetadata, i: int, block_size: int) -> PrefillChunk:
    start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
    seq_len, query_len = metadata.seq_lens[i], end - start
    if seq_len == query_len:
        return PrefillChunk(i, start, end, seq_len, None, None)
    device = metadata.block_tables.device
    positions = torch.arange(seq_len - query_len, seq_len, device=device)
    mask = torch.arange(seq_len, device=device)[None, :] <= positions[:, None]
    block_ids = metadata.block_tables[i, :blocks_for(seq_len, block_size)]
    return PrefillChunk(i, start, end, seq_len, block_ids, mask)


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


def additive_mask(
    visible: torch.Tensor, dtype: torch.dtype, cache: dict[torch.dtype, torch.Tensor],
) -> torch.Tensor:
    """0 / -inf in `dtype`, made once per step: SDPA would convert a bool mask every call."""
    if dtype not in cache:
        zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        cache[dtype] = zeros.masked_fill_(~visible, float("-inf"))
    return cache[dtype]


def expand_for_heads(
    plan: StepPlan, slot_mapping: torch.Tensor, num_kv_heads: int, kernel: bool,
) -> HeadPlan:
    """Block ids -> rows of the cache viewed as [num_blocks * num_kv_heads, block_size, D]."""
    heads = torch.arange(num_kv_heads, dtype=torch.int64, device=slot_mapping.device)
    decode_pieces = []
    if not kernel and plan.decodes is not None:
        decode_pieces = [(bucket.block_ids[:, None, :] * num_kv_heads + heads[None, :, None])
                         .flatten() for bucket in decode_buckets(plan.decodes, plan.block_size)]
    prefill_pieces = [(chunk.block_ids[None, :] * num_kv_heads + heads[:, None]).flatten()
                      for chunk in plan.prefills if chunk.block_ids is not None
                      and not (kernel and plan.kernel_covers(chunk))]
    pieces = decode_pieces + prefill_pieces
    starts = [0, *itertools.accumulate(piece.numel() for piece in pieces)]
    write_rows = cache_rows(slot_mapping, plan.block_size, num_kv_heads)
    return HeadPlan(
        write_rows=write_rows,
        max_write_row=int(write_rows.max()) if write_rows.numel() else -1,
        gather_rows=torch.cat(pieces) if pieces else heads[:0],
        decode_starts=starts[:len(decode_pieces)],
        prefill_starts=starts[len(decode_pieces):len(pieces)],
    )


def cache_rows(slot_mapping: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row of each (token, kv head) in the cache viewed as [num_blocks * H * block_size, D]."""
    heads = torch.arange(num_kv_heads, dtype=torch.int64, device=slot_mapping.device)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    return ((blocks[:, None] * num_kv_heads + heads[None, :]) * block_size
            + offsets[:, None]).flatten()


# ---------------------------------------------------------------- per layer


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    rows = cache_rows(slot_mapping, k_cache.shape[2], k_cache.shape[1])
    write_kv_rows(k, v, k_cache, v_cache, rows)


def write_kv_rows(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    rows: torch.Tensor, max_row: int | None = None,
) -> None:
    """One indexed copy per cache; eager on the CPU one C++ call for both, reading k and v in
    place (on a fused qkv row they are strided slices that `reshape` would copy). `max_row`:
    the largest of `rows`, if the caller knows it."""
    if cpp_write_applies(k, v, k_cache, v_cache):
        if max_row is None:
            max_row = int(rows.max()) if rows.numel() else -1
        run_write_kv(k, v, k_cache, v_cache, rows, max_row)
        return
    head_dim = k_cache.shape[-1]
    k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if metadata.static or triton_applies(q, k_cache):
        return triton_paged_attention(q, k, v, k_cache, v_cache, metadata, scale)
    plan = metadata.step_plan(block_size)
    use_kernel = plan.kernel_rows is not None and cpp_decode_applies(q, k_cache, v_cache)
    head_plan = metadata.head_plan(num_kv_heads, block_size, kernel=use_kernel)
    write_kv_rows(k, v, k_cache, v_cache, head_plan.write_rows, head_plan.max_write_row)
    keys = values = None
    if head_plan.gather_rows.numel():
        keys, values = gather_context(k_cache, v_cache, head_plan.gather_rows,
                                      metadata.workspace)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if use_kernel:
        assert plan.kernel_rows is not None
        run_paged_decode(q, k_cache, v_cache, plan.kernel_rows, scale, out)
    elif plan.decodes is not None:
        buckets = decode_buckets(plan.decodes, block_size)
        in_place = len(buckets) == 1 and buckets[0].row_range == (0, buckets[0].size)
        for bucket, start in zip(buckets, head_plan.decode_starts, strict=True):
            decode_bucket(q, out, bucket, keys, values, start, num_kv_heads, scale, in_place)
    cached_starts = iter(head_plan.prefill_starts)
    for chunk in plan.prefills:
        if use_kernel and plan.kernel_covers(chunk):
            continue
        if chunk.has_cached_prefix:
            prefill_on_cache(q, out, chunk, keys, values, next(cached_starts), num_kv_heads, scale)
        else:
            prefill_fresh(q, k, v, out, chunk, scale)
    return out


@torch.library.custom_op("loom::paged_attention", mutates_args=("k_cache", "v_cache"))
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float,
) -> torch.Tensor:
    """`paged_attention` over the step's metadata (`engine.forward_context`), as one opaque
    torch op: a compiled forward keeps its graph whole around it."""
    return paged_attention(q, k, v, k_cache, v_cache, current_metadata(), scale)


@attention_op.register_fake
def _attention_op_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float,
) -> torch.Tensor:
    """What a model layer calls: the op when compiling, the plain function (no op dispatch
    cost) when eager."""
    if torch.compiler.is_compiling():
        return attention_op(q, k, v, k_cache, v_cache, scale)
    return paged_attention(q, k, v, k_cache, v_cache, current_metadata(), scale)


def gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One index_select per cache into reused buffers: [R, block_size, head_dim] each."""
    row_shape = k_cache.shape[2:]
    numel = rows.numel() * row_shape.numel()
    keys = workspace.get("k", numel, k_cache.dtype, k_cache.device).view(-1, *row_shape)
    values = workspace.get("v", numel, v_cache.dtype, v_cache.device).view(-1, *row_shape)
    if numel:
        torch.index_select(k_cache.view(-1, *row_shape), 0, rows, out=keys)
        torch.index_select(v_cache.view(-1, *row_shape), 0, rows, out=values)
    return keys, values


def segment(
    buffer: torch.Tensor, start: int, count: int, num_kv_heads: int, num_blocks: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`count * num_kv_heads * num_blocks` gathered rows from `start` as [count, H, L, D]."""
    block_size, head_dim = buffer.shape[1], buffer.shape[2]
    rows = buffer[start:start + count * num_kv_heads * num_blocks]
    return rows.view(count, num_kv_heads, num_blocks * block_size, head_dim).to(dtype)


def decode_bucket(
    q: torch.Tensor, out: torch.Tensor, bucket: DecodeBucket, keys: torch.Tensor,
    values: torch.Tensor, start: int, num_kv_heads: int, scale: float, in_place: bool,
) -> None:
    """The query heads sharing a KV head are folded into the query axis: [n, H_kv, group, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    n = bucket.size
    key_seg = segment(keys, start, n, num_kv_heads, bucket.num_blocks, q.dtype)
    value_seg = segment(values, start, n, num_kv_heads, bucket.num_blocks, q.dtype)
    if bucket.row_range is not None:
        query = q[bucket.row_range[0]:bucket.row_range[1]]
    else:
        query = q.index_select(0, bucket.rows)
    query = query.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    target = out[:n].view(query.shape) if in_place else None
    attend = attend_matmul if decode_uses_matmul(q) else attend_sdpa
    attended = attend(query, key_seg, value_seg, bucket, scale, target)
    if in_place:
        return
    attended = attended.view(n, num_heads, head_dim)
    if bucket.row_range is not None:
        out[bucket.row_range[0]:bucket.row_range[1]] = attended
    else:
        out.index_copy_(0, bucket.rows, attended)


def decode_uses_matmul(query: torch.Tensor) -> bool:
    if DECODE_KERNEL != "auto":
        return DECODE_KERNEL == "matmul"
    if query.device.type != "cpu":
        return False
    return query.dtype == torch.float32 or (query.dtype == torch.bfloat16
                                            and native_bf16_matmul())


def attend_matmul(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bucket: DecodeBucket,
    scale: float, out: torch.Tensor | None,
) -> torch.Tensor:
    """Explicit matmul -> fp32 masked softmax -> matmul."""
    bias = additive_mask(bucket.visible, torch.float32, bucket.biases)
    scores = torch.matmul(query * scale, keys.transpose(2, 3)).float().add_(bias)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    if out is None:
        return torch.matmul(probs, values)
    return torch.matmul(probs, values, out=out)


def attend_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bucket: DecodeBucket,
    scale: float, out: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA's fused CPU kernel converts bf16 tiles itself: the choice without native bf16."""
    bias = additive_mask(bucket.visible, query.dtype, bucket.biases)
    attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scale)
    return attended if out is None else out.copy_(attended)


def prefill_fresh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, chunk: PrefillChunk,
    scale: float,
) -> None:
    """No cached prefix: plain causal attention over the chunk's own K/V."""
    rows = slice(chunk.start, chunk.end)
    attended = F.scaled_dot_product_attention(
        heads_first(q[rows]), heads_first(k[rows]).to(q.dtype), heads_first(v[rows]).to(q.dtype),
        is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    out[rows] = attended[0].transpose(0, 1)


def prefill_on_cache(
    q: torch.Tensor, out: torch.Tensor, chunk: PrefillChunk, keys: torch.Tensor,
    values: torch.Tensor, start: int, num_kv_heads: int, scale: float,
) -> None:
    """New tokens on cached ones: attend the gathered context under a causal-offset mask."""
    assert chunk.block_ids is not None and chunk.mask is not None
    rows, num_blocks = slice(chunk.start, chunk.end), chunk.block_ids.numel()
    key_seg = segment(keys, start, 1, num_kv_heads, num_blocks, q.dtype)
    value_seg = segment(values, start, 1, num_kv_heads, num_blocks, q.dtype)
    attended = F.scaled_dot_product_attention(
        heads_first(q[rows]), key_seg[:, :, :chunk.seq_len], value_seg[:, :, :chunk.seq_len],
        attn_mask=additive_mask(chunk.mask, q.dtype, chunk.biases), scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )
    out[rows] = attended[0].transpose(0, 1)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D]: SDPA's fused CPU kernel only takes 4-D inputs."""
    return x.transpose(0, 1).unsqueeze(0)


def triton_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """CUDA with triton installed, power-of-two head dim and block size (`tl.arange`)."""
    return (TRITON_ATTENTION and q.is_cuda
            and triton_supports(head_dim=q.shape[-1], block_size=k_cache.shape[2]))


def triton_supports(head_dim: int, block_size: int) -> bool:
    return (triton_installed() and not head_dim & (head_dim - 1)
            and not block_size & (block_size - 1))


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """The step's KV write and its attention, one Triton launch each (engine.triton_attention)."""
    if metadata.triton_rows is None:
        metadata.triton_rows = query_rows(metadata, q.device)
    triton_write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    return triton_attention(q, k_cache, v_cache, metadata.block_tables, metadata.triton_rows,
                            scale)


def query_rows(metadata: AttentionMetadata, device: torch.device) -> QueryRows:
    """Every query row of the step as the Triton kernel reads it (see `causal_rows`)."""
    _, seq_lens, owners = causal_rows(metadata, range(metadata.num_requests))
    return QueryRows(device_tensor(owners, torch.int32, device),
                     device_tensor(seq_lens, torch.int32, device))


def cpp_write_applies(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> bool:
    return (
        CPP_DECODE
        and not torch.compiler.is_compiling()
        and k.is_cpu and v.is_cpu and k_cache.is_cpu and v_cache.is_cpu
        and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and rows_of_contiguous_heads(k) and rows_of_contiguous_heads(v)
        and load_cpp_library() is not None
    )


def cpp_decode_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        CPP_DECODE
        and kernel_supports(q, k_cache, v_cache)
        and load_cpp_decode() is not None
    )


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    metadata: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Straightforward per-request attention over the paged cache: slow, obviously right."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(metadata.seq_lens):
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_tables[i, :num_blocks]
        keys = k_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        values = v_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        keys, values = keys[:, :seq_len], values[:, :seq_len]
        query = q[start:end].transpose(0, 1)  # [H, Lq, D]
        query_len = end - start
        positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        attended = F.scaled_dot_product_attention(
            query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = attended.transpose(0, 1)
    return out
