"""One step's attention metadata and its plan, shared by every layer of the step.

The attention backend chosen at start-up (engine.attention.selector) builds one
`AttentionMetadata` per step for the flattened variable-length batch before the forward
(`AttentionBackend.build_metadata`): query offsets, context lengths, block tables, slot
mapping, and what its layers will read of it, planned once (the decode/prefill split, the C++
kernel's rows, decode buckets for the torch path, gather rows and masks).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.attention.decode_buckets import DecodeBatch, decode_buckets
from engine.attention.triton_kernels import QueryRows
from engine.attention.workspace import DEFAULT_WORKSPACE, Workspace
from engine.kv_cache_groups import blocks_for
from engine.platform.host_copy import int_tensor

# Without the tiled prefill kernel (fp32 caches; CPUs with neither AMX nor AVX512-BF16), the
# C++ decode kernel takes every prefill chunk, each query row a decode over its own causal
# prefix: no masked rectangle on cached tokens, a row's bits the same however its prompt is
# chunked, and faster than SDPA at every length measured (AVX-512, bf16 and fp32: 2,048 fresh
# tokens 24 vs 51 ms a layer, 1,024 on 1,024 cached 24 vs 60; docs/benchmarks.md).
# Where the backend has the tiled prefill kernel, it takes every chunk of this many tokens and
# more: all of them, so that a prompt's rows come out the same whether its first blocks were
# cached (a short chunk left) or not (a long one) (engine.layers.batch_invariant). Below 16
# rows the decode kernel's rows are ~0.03 ms a layer faster; from 16 on, the tiles are.
TILED_PREFILL_MIN_TOKENS = 2
# A request's rows read its blocks together in runs of up to this many (kMaxRun in
# kernels/cpu/paged_decode.cpp).
MAX_RUN_ROWS = 16


@dataclass(slots=True)
class PrefillChunk:
    """A request with several new tokens; on cached tokens it reads its blocks under a mask."""

    request: int  # its index in the metadata
    start: int  # its queries are rows [start, end) of q
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [num_blocks] int64 when it sits on cached tokens
    # [query_len, seq_len] bool: key j visible to query i (on cached tokens, for the torch path)
    mask: torch.Tensor | None
    biases: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive masks
    window_biases: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    @property
    def has_cached_prefix(self) -> bool:
        return self.block_ids is not None


@dataclass(slots=True)
class PrefillBatch:
    """Prefill chunks for the tiled prefill kernel: each chunk's rows over its whole context."""

    chunks: list[PrefillChunk]
    q_starts: torch.Tensor  # [n] int64: the chunks' first rows of q
    query_lens: torch.Tensor  # [n] int64
    seq_lens: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [n, max_blocks] int64
    max_block: int

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def seq_len_list(self) -> list[int]:
        return [chunk.seq_len for chunk in self.chunks]


@dataclass(slots=True)
class StepPlan:
    """Everything derivable from the metadata alone, shared by every layer of a step."""

    block_size: int
    decodes: DecodeBatch | None
    prefills: list[PrefillChunk]
    # The C++ kernel's rows: every decode, then every row of the prefill chunks it takes
    kernel_rows: DecodeBatch | None = None
    tiled_prefills: PrefillBatch | None = None  # the long chunks, where the tiled kernel serves
    kernel_prefills: frozenset[int] = frozenset()  # requests whose chunk is in either

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
    plan: StepPlan | None = None  # made by the backend's builder (none for Triton)
    row_requests: frozenset[int] = frozenset()  # drafted decodes: their rows are decode rows
    workspace: Workspace = field(default_factory=lambda: DEFAULT_WORKSPACE)
    head_plans: dict[int, HeadPlan] = field(default_factory=dict)  # by KV head count
    triton_rows: QueryRows | None = None  # the Triton kernels' per-row view, made once a step
    # Recorded into a CUDA graph (engine.executor.cuda_graphs): only the tensors above are the
    # step's, the lists are the recording's, so attention takes the Triton path, which
    # reads no list.
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
        workspace: Workspace | None = None, row_requests: frozenset[int] = frozenset(),
    ) -> AttentionMetadata:
        """One step's metadata, unplanned: the backend's builder plans what its layers read."""
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
            row_requests=row_requests,
        )
        return metadata

    def planned(self, num_kv_heads: int) -> tuple[StepPlan, HeadPlan]:
        """The step plan and its expansion for `num_kv_heads`, as the builder made them."""
        if self.plan is None or num_kv_heads not in self.head_plans:
            raise RuntimeError(f"attention metadata for {num_kv_heads} KV heads used before "
                               "its backend planned it")
        return self.plan, self.head_plans[num_kv_heads]


# ---------------------------------------------------------------- planning, once per step


def plan_step(metadata: AttentionMetadata, block_size: int, kernel: bool,
              tiled_prefill: bool = False, rows_only: bool = False) -> StepPlan:
    """`kernel`: the C++ kernel takes every decode, and every row of the prefill chunks and
    drafted decodes the tiled kernel does not take; `tiled_prefill`: the tiled kernel takes the
    chunks of TILED_PREFILL_MIN_TOKENS and more but drafted decodes (`row_requests`: a few
    rows would cost it their context's layout); `rows_only`: every row of every chunk is a
    decode row (batch-invariant mode: one kernel per row)."""
    query_lens = metadata.query_lens
    if metadata.block_tables.shape[1] * block_size < max(metadata.seq_lens, default=0):
        raise ValueError("block tables are narrower than the longest context")
    decode_ids = [i for i, query_len in enumerate(query_lens) if query_len == 1]
    prefill_ids = [i for i, query_len in enumerate(query_lens) if query_len > 1]
    as_rows = metadata.row_requests if kernel and not rows_only else frozenset()
    tiled_ids = {i for i in prefill_ids if kernel and tiled_prefill and not rows_only
                 and i not in as_rows and query_lens[i] >= TILED_PREFILL_MIN_TOKENS}
    row_chunks = [i for i in prefill_ids if kernel and i not in tiled_ids]
    covered = frozenset(row_chunks) | tiled_ids
    prefills = [plan_prefill(metadata, i, block_size, masked=i not in covered)
                for i in prefill_ids]
    decodes = plan_decodes(metadata, decode_ids) if decode_ids else None
    if not kernel:
        return StepPlan(block_size, decodes, prefills)
    kernel_rows = decodes
    if row_chunks:
        kernel_rows = plan_rows(metadata, decode_ids + row_chunks, runs=not rows_only)
    tiled_chunks = [chunk for chunk in prefills if chunk.request in tiled_ids]
    tiled = plan_prefill_batch(metadata, tiled_chunks) if tiled_chunks else None
    return StepPlan(block_size, decodes, prefills, kernel_rows, tiled, covered)


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


def plan_rows(metadata: AttentionMetadata, ids: list[int], runs: bool) -> DecodeBatch:
    """Every query row of the requests `ids`, each as a decode over its causal prefix; `runs`:
    a request's rows read its blocks together, up to MAX_RUN_ROWS at a time."""
    device = metadata.block_tables.device
    rows, seq_lens, owners = causal_rows(metadata, ids)
    block_tables = metadata.block_tables.index_select(0, int_tensor(owners, device))
    offsets = run_offsets(owners) if runs and len(owners) > len(ids) else None
    return DecodeBatch(rows, seq_lens, int_tensor(rows, device), int_tensor(seq_lens, device),
                       block_tables, int(block_tables.max()),
                       runs=None if offsets is None else int_tensor(offsets, device))


def run_offsets(owners: list[int]) -> list[int]:
    """Where each run of rows starts (and the end): a new owner or MAX_RUN_ROWS rows."""
    offsets = [0]
    for j in range(1, len(owners)):
        if owners[j] != owners[j - 1] or j - offsets[-1] == MAX_RUN_ROWS:
            offsets.append(j)
    return [*offsets, len(owners)]


def plan_prefill_batch(metadata: AttentionMetadata, chunks: list[PrefillChunk]) -> PrefillBatch:
    device = metadata.block_tables.device
    requests = [chunk.request for chunk in chunks]
    block_tables = metadata.block_tables.index_select(0, int_tensor(requests, device))
    return PrefillBatch(
        chunks=chunks,
        q_starts=int_tensor([chunk.start for chunk in chunks], device),
        query_lens=int_tensor([chunk.end - chunk.start for chunk in chunks], device),
        seq_lens=int_tensor([chunk.seq_len for chunk in chunks], device),
        block_tables=block_tables,
        max_block=int(block_tables.max()),
    )


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


def plan_prefill(metadata: AttentionMetadata, i: int, block_size: int,
                 masked: bool = True) -> PrefillChunk:
    """`masked`: build the causal mask of a chunk on cached tokens (the torch path's; a
    kernel of ours needs none)."""
    start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
    seq_len, query_len = metadata.seq_lens[i], end - start
    if seq_len == query_len:
        return PrefillChunk(i, start, end, seq_len, None, None)
    device = metadata.block_tables.device
    mask = None
    if masked:
        positions = torch.arange(seq_len - query_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= positions[:, None]
    block_ids = metadata.block_tables[i, :blocks_for(seq_len, block_size)]
    return PrefillChunk(i, start, end, seq_len, block_ids, mask)


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
