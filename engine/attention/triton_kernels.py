"""Triton kernels behind the Triton attention backend (engine.attention.triton_backend), for
CUDA devices: the KV-cache write through the slot mapping, and paged attention over the block
tables for a whole varlen step in one launch.

- `write_kv`: one program per new token writes its K and V heads into their cache rows.
- `paged_attention`: one program per (query row, KV head). A query row is a decode, or one
  token of a prefill chunk attending causally over its own prefix (the cached tokens and
  the chunk's earlier ones, all in the cache by then), so decodes, prefills on cached
  tokens and fresh prefills share one kernel and one launch. The program walks the row's
  tokens a tile of several blocks at a time (`TILE_TOKENS`, each token's block looked up in
  the row's table) with an online softmax in fp32 and serves the KV head's whole query group
  (GQA) at once, each K/V tile loaded once for the group.

Both products run through `tl.dot` (tensor cores; fp32 caches with fp32 products), the
query group padded to 16 rows: with elementwise multiply-and-sum instead, a program's
[group, tile, head_dim] temporaries spilled, and the kernel read KV at ~10% of an H200's
bandwidth (4-5x slower). The same code runs in Triton's interpreter (`TRITON_INTERPRET=1`),
where the tests check it on the CPU against the torch reference.
`triton` is imported lazily: a CPU-only install never needs it (`pip install .[gpu]`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class QueryRows:
    """Per query row of a step: the request's row of the block tables and how many tokens
    it sees (its position + 1). Built once per step by the backend's builder
    (engine.attention.triton_backend), shared by every layer."""

    request: torch.Tensor  # [T] int32
    context_len: torch.Tensor  # [T] int32


NO_WINDOW = 1 << 30  # a window longer than any context
# A paged-attention program's launch (bench.triton_attention; docs/benchmarks.md "The Triton
# attention kernel on an H200"): tokens read per iteration, several blocks with their loads in
# flight together, and warps.
TILE_TOKENS = 64
WARPS = 4
DOT_ROWS = 16  # tl.dot's smallest tile: a KV head's query group is padded to it


def supported_shape(head_dim: int, block_size: int) -> bool:
    """Powers of two (`tl.arange`), the head at least `tl.dot`'s smallest tile."""
    return (not head_dim & (head_dim - 1) and not block_size & (block_size - 1)
            and head_dim >= DOT_ROWS)


@functools.cache
def kernels() -> Any:
    """The jitted kernels (imports triton; TRITON_INTERPRET must be set before the first call
    for the interpreter to take them)."""
    import triton
    import triton.language as tl

    @triton.jit
    def write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_token_stride,
                        v_token_stride, num_kv_heads, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        dims = tl.arange(0, HEAD_DIM)
        row = ((block * num_kv_heads + head) * BLOCK_SIZE + offset) * HEAD_DIM
        k = tl.load(k_ptr + token * k_token_stride + head * HEAD_DIM + dims)
        v = tl.load(v_ptr + token * v_token_stride + head * HEAD_DIM + dims)
        tl.store(k_cache_ptr + row + dims, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + row + dims, v.to(v_cache_ptr.dtype.element_ty))

    @triton.jit
    def paged_attention_kernel(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, tables_ptr,
                               requests_ptr, context_lens_ptr, q_token_stride, out_token_stride,
                               table_stride, num_kv_heads, scale, window, GROUP: tl.constexpr,
                               GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                               TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                               SOFTCAP: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        request = tl.load(requests_ptr + row).to(tl.int64)
        context_len = tl.load(context_lens_ptr + row)
        group = tl.arange(0, GROUP_PAD)
        in_group = group < GROUP
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + group
        q = tl.load(q_ptr + row * q_token_stride + heads[:, None] * HEAD_DIM + dims[None, :],
                    mask=in_group[:, None], other=0.0)
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        tokens = tl.arange(0, TILE)
        first = tl.maximum(context_len - window, 0)  # the first token the row sees
        table = tables_ptr + request * table_stride
        for start in range(first // TILE * TILE, context_len, TILE):
            positions = start + tokens
            visible = (positions < context_len) & (positions >= first)
            block = tl.load(table + positions // BLOCK_SIZE, mask=visible, other=0)
            rows = ((block.to(tl.int64) * num_kv_heads + kv_head) * BLOCK_SIZE
                    + positions % BLOCK_SIZE)
            offsets = rows[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=visible[:, None], other=0.0)
            v = tl.load(v_cache_ptr + offsets, mask=visible[:, None], other=0.0)
            # [GROUP_PAD, TILE] on tensor cores, summed in fp32 (and fp32 products for fp32)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale
            if SOFTCAP > 0:  # SOFTCAP * tanh(scores / SOFTCAP), tanh through the sigmoid
                scores = SOFTCAP * (2.0 * tl.sigmoid(2.0 * scores / SOFTCAP) - 1.0)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            total = total * rescale + tl.sum(weights, axis=1)
            values = tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            acc = acc * rescale[:, None] + values
            running_max = new_max
        out = acc / total[:, None]
        tl.store(out_ptr + row * out_token_stride + heads[:, None] * HEAD_DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])

    return write_kv_kernel, paged_attention_kernel


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] (each token's heads back to back) into the caches
    [num_blocks, kv_heads, block_size, D] at `slot_mapping` [T] (block * block_size + offset)."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    write_kv_kernel, _ = kernels()
    write_kv_kernel[(tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), num_kv_heads,
        BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=head_dim)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, rows: QueryRows, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    tile_tokens: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """q [T, heads, D] over the caches: each row attends its request's first
    `rows.context_len` tokens (the last `window` of them, with one), its scaled scores
    soft-capped at `softcap` where given. Returns [T, heads, D] in q's dtype. `tile_tokens`
    (a power of two) and `num_warps` shape the launch: the module's defaults unless given
    (bench.triton_attention sweeps them)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads for {num_kv_heads} KV heads")
    if not supported_shape(head_dim, block_size):
        raise ValueError(f"head_dim {head_dim} and block_size {block_size} must be powers of 2"
                         f" and head_dim at least {DOT_ROWS}")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = max(DOT_ROWS, 1 << (group - 1).bit_length())
    _, paged_attention_kernel = kernels()
    paged_attention_kernel[(tokens, num_kv_heads)](
        q, out, k_cache, v_cache, block_tables, rows.request, rows.context_len, q.stride(0),
        out.stride(0), block_tables.stride(0), num_kv_heads, scale, window or NO_WINDOW,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size,
        TILE=max(block_size, tile_tokens or TILE_TOKENS), HEAD_DIM=head_dim,
        SOFTCAP=float(softcap or 0.0), num_warps=num_warps or WARPS)
    return out
