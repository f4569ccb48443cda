"""Triton kernels behind the Triton attention backend (engine.attention.triton_backend), for
CUDA devices: the KV-cache write through the slot mapping, and paged attention over the block
tables for a whole varlen step in one launch.

- `write_kv`: one program per new token writes its K and V heads into their cache rows.
- `paged_attention`: one program per (query row, KV head). A query row is a decode, or one
  token of a prefill chunk attending causally over its own prefix (the cached tokens and
  the chunk's earlier ones, all in the cache by then), so decodes, prefills on cached
  tokens and fresh prefills share one kernel and one launch. The program walks the row's
  blocks with an online softmax in fp32 and serves the KV head's whole query group (GQA) at
  once, each K/V block loaded once for the group.

The products are elementwise multiply-and-sum rather than `tl.dot` (which wants tiles of 16
or more): a decode row is memory-bound either way, and the same code runs in Triton's
interpreter (`TRITON_INTERPRET=1`), where the tests check it on the CPU against the torch
reference. Long prefills on a GPU would go faster with a tiled kernel; that is a later step.
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
                               HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        request = tl.load(requests_ptr + row).to(tl.int64)
        context_len = tl.load(context_lens_ptr + row)
        group = tl.arange(0, GROUP_PAD)
        in_group = group < GROUP
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + group
        q = tl.load(q_ptr + row * q_token_stride + heads[:, None] * HEAD_DIM + dims[None, :],
                    mask=in_group[:, None], other=0.0).to(tl.float32) * scale
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        tokens = tl.arange(0, BLOCK_SIZE)
        first = tl.maximum(context_len - window, 0)  # the first token the row sees
        for start in range(first // BLOCK_SIZE * BLOCK_SIZE, context_len, BLOCK_SIZE):
            block = tl.load(tables_ptr + request * table_stride + start // BLOCK_SIZE)
            visible = (start + tokens < context_len) & (start + tokens >= first)
            rows = ((block.to(tl.int64) * num_kv_heads + kv_head) * BLOCK_SIZE + tokens)
            offsets = rows[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
            if SOFTCAP > 0:  # SOFTCAP * tanh(scores / SOFTCAP), tanh through the sigmoid
                scores = SOFTCAP * (2.0 * tl.sigmoid(2.0 * scores / SOFTCAP) - 1.0)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
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
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, heads, D] over the caches: each row attends its request's first
    `rows.context_len` tokens (the last `window` of them, with one), its scaled scores
    soft-capped at `softcap` where given. Returns [T, heads, D] in q's dtype."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads for {num_kv_heads} KV heads")
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"head_dim {head_dim} and block_size {block_size} must be powers of 2")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    group = num_heads // num_kv_heads
    _, paged_attention_kernel = kernels()
    paged_attention_kernel[(tokens, num_kv_heads)](
        q, out, k_cache, v_cache, block_tables, rows.request, rows.context_len, q.stride(0),
        out.stride(0), block_tables.stride(0), num_kv_heads, scale, window or NO_WINDOW,
        GROUP=group, GROUP_PAD=max(1, 1 << (group - 1).bit_length()), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, SOFTCAP=float(softcap or 0.0))
    return out
