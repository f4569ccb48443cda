"""Paged attention: the ONE function boundary between the model and the KV cache layout.

The KV cache of one layer is a pair of tensors shaped
[num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a block).
Every step the model runner builds one AttentionMetadata for the flattened
variable-length batch (`AttentionMetadata.build`); each layer calls
`paged_attention`, which writes the step's new K/V through the slot mapping and
attends each request's queries over its whole context (cached blocks + the new
tokens, causally).

Everything derivable from the metadata alone (decode/prefill split, gather
indices, masks) is planned once per step and shared by all layers
(engine.attention.metadata). Where the small C++ kernel is enabled and compiles,
it reads the paged cache in place for every request with one new token
("decodes") and for every row of the prefill chunks up to
KERNEL_PREFILL_MAX_TOKENS, each row a decode over its own causal prefix.
Otherwise decodes take one gather into a reused buffer with the query heads of
each KV head folded into one attention call, and prefill chunks use SDPA's fused
causal kernel, with a causal-offset mask when they sit on cached tokens. The
torch decode path reads padding slots past a request's context and masks them
out, so the caches must hold finite values everywhere: allocate them with
`torch.zeros`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Literal

import torch
import torch.nn.functional as F

from engine.attention.forward_context import current_metadata
from engine.attention.metadata import (
    AttentionMetadata,
    DecodeBucket,
    PrefillChunk,
    Workspace,
    additive_mask,
    cache_rows,
    causal_rows,
    decode_buckets,
)
from engine.attention.triton_kernels import QueryRows
from engine.attention.triton_kernels import paged_attention as triton_attention
from engine.attention.triton_kernels import write_kv as triton_write_kv
from engine.kernels.elementwise import rows_of_contiguous_heads
from engine.kernels.paged_decode import (
    kernel_supports,
    load_cpp_decode,
    load_cpp_library,
    run_paged_decode,
    run_write_kv,
)
from engine.platform.cpu import native_bf16_matmul
from engine.platform.host_copy import device_tensor

logger = logging.getLogger(__name__)

# How a decode bucket is computed on the torch path: "auto" takes explicit matmuls where the
# CPU has native GEMMs for the dtype (fp32; bf16 with AVX512-BF16/AMX), else SDPA's kernel.
DECODE_KERNEL: Literal["auto", "matmul", "sdpa"] = "auto"
# The C++ paged-decode kernel (CPU, fp32/bf16); LOOM_CPP_DECODE=0 turns it off.
CPP_DECODE = os.environ.get("LOOM_CPP_DECODE", "1") != "0"
# On CUDA with triton installed, one Triton launch per layer writes the KV and one attends
# (engine.attention.triton_kernels); LOOM_TRITON_ATTENTION=0 keeps the torch path there.
TRITON_ATTENTION = os.environ.get("LOOM_TRITON_ATTENTION", "1") != "0"



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
    """`paged_attention` over the step's metadata (`engine.attention.forward_context`), as one
    opaque torch op: a compiled forward keeps its graph whole around it."""
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
    """The step's KV write and its attention, one Triton launch each
    (engine.attention.triton_kernels)."""
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
