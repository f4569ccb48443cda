"""Paged attention in torch ops, for any device: the fallback where no kernel of ours serves.

Decodes take one gather into a reused buffer with the query heads of each KV head folded into
one attention call, bucketed by context length (engine.attention.metadata); prefill chunks use
SDPA's fused causal kernel, with a causal-offset mask when they sit on cached tokens. Decodes
read padding slots past a request's context and mask them out, so the caches must hold finite
values everywhere: allocate them with `torch.zeros`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.attention.decode_buckets import DecodeBucket, decode_buckets
from engine.attention.metadata import (
    AttentionMetadata,
    HeadPlan,
    PrefillChunk,
    StepPlan,
    Workspace,
    additive_mask,
    cache_rows,
    expand_for_heads,
    plan_step,
)
from engine.attention.quantized_kv import (
    dequantize_rows,
    is_quantized,
    quantize_rows,
    rotate,
    round_trip,
)
from engine.platform.cpu import native_bf16_matmul

DecodeKernel = Literal["matmul", "sdpa"]


class TorchBackend(AttentionBackend):
    name = "torch"
    uses_kernel = False  # the C++ kernel serves the plan's kernel rows (see cpu_backend)
    tiled_prefill = False  # ... and the tiled kernel its long prefill chunks
    rows_only = False  # ... or every query row (batch-invariant mode)

    def __init__(self, block_size: int, num_kv_heads: int,
                 decode_kernel: DecodeKernel = "matmul") -> None:
        """`decode_kernel`: how a decode bucket is computed (the selector passes the device's
        choice, `decode_kernel_for`)."""
        super().__init__(block_size, num_kv_heads)
        self.decode_kernel = decode_kernel

    def plan(self, metadata: AttentionMetadata) -> None:
        metadata.plan = plan_step(metadata, self.block_size, kernel=self.uses_kernel,
                                  tiled_prefill=self.tiled_prefill, rows_only=self.rows_only)
        metadata.head_plans[self.num_kv_heads] = expand_for_heads(
            metadata.plan, metadata.slot_mapping, self.num_kv_heads, self.uses_kernel)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        rows = cache_rows(slot_mapping, k_cache.shape[2], k_cache.shape[1])
        self.write_rows(k, v, k_cache, v_cache, rows, None)

    def write_rows(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: torch.Tensor, max_row: int | None) -> None:
        """One indexed copy per cache, to `rows` of the caches viewed as [-1, row width]
        (8-bit caches: the rows' codes and scales, engine.attention.quantized_kv)."""
        write_cache_rows(k, k_cache, rows)
        write_cache_rows(v, v_cache, rows)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        if is_quantized(k_cache.dtype):  # its rows are rotated (engine.attention.quantized_kv)
            return rotate(self.attend(rotate(q), rotate(k), rotate(v), k_cache, v_cache,
                                      metadata, scale, window, softcap))
        return self.attend(q, k, v, k_cache, v_cache, metadata, scale, window, softcap)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        window: int | None, softcap: float | None,
    ) -> torch.Tensor:
        num_kv_heads = k_cache.shape[1]
        plan, head_plan = metadata.planned(num_kv_heads)
        self.write_rows(k, v, k_cache, v_cache, head_plan.write_rows, head_plan.max_write_row)
        keys = values = None
        if head_plan.gather_rows.numel():
            keys, values = gather_context(k_cache, v_cache, head_plan.gather_rows,
                                          metadata.workspace, q.dtype)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.uses_kernel:
            self.attend_kernel_rows(q, k_cache, v_cache, metadata, scale, out, window, softcap)
        elif plan.decodes is not None:
            self.attend_decodes(q, out, plan, head_plan, keys, values, num_kv_heads, scale,
                                window, softcap)
        cached_starts = iter(head_plan.prefill_starts)
        for chunk in plan.prefills:
            if self.uses_kernel and plan.kernel_covers(chunk):
                continue
            if chunk.has_cached_prefix:
                prefill_on_cache(q, out, chunk, keys, values, next(cached_starts), num_kv_heads,
                                 scale, window, softcap)
            else:  # the chunk's own K/V as the cache holds them
                prefill_fresh(q, round_trip(k, k_cache.dtype), round_trip(v, v_cache.dtype),
                              out, chunk, scale, window, softcap)
        return out

    def attend_kernel_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                           window: int | None, softcap: float | None) -> None:
        raise NotImplementedError("the torch backend has no kernel rows")

    def attend_decodes(self, q: torch.Tensor, out: torch.Tensor, plan: StepPlan,
                       head_plan: HeadPlan, keys: torch.Tensor | None,
                       values: torch.Tensor | None, num_kv_heads: int, scale: float,
                       window: int | None, softcap: float | None) -> None:
        assert plan.decodes is not None and keys is not None and values is not None
        buckets = decode_buckets(plan.decodes, plan.block_size)
        in_place = len(buckets) == 1 and buckets[0].row_range == (0, buckets[0].size)
        use_matmul = self.decode_kernel == "matmul" or softcap is not None  # SDPA cannot cap
        for bucket, start in zip(buckets, head_plan.decode_starts, strict=True):
            decode_bucket(q, out, bucket, keys, values, start, num_kv_heads, scale, in_place,
                          use_matmul, window, softcap)


def decode_kernel_for(device: torch.device, dtype: torch.dtype) -> DecodeKernel:
    """Explicit matmuls where the CPU has native GEMMs for the dtype (fp32; bf16 with
    AVX512-BF16/AMX), else SDPA's fused kernel (it converts bf16 tiles itself)."""
    native = device.type == "cpu" and (dtype == torch.float32 or (
        dtype == torch.bfloat16 and native_bf16_matmul()))
    return "matmul" if native else "sdpa"


def write_cache_rows(x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor) -> None:
    """x [T, H, D] into `rows` of the cache viewed as [-1, its row width]."""
    values = x.reshape(-1, x.shape[-1])
    width = cache.shape[-1]
    if is_quantized(cache.dtype):
        values = quantize_rows(values, cache.dtype)
        cache, values = cache.view(torch.int8), values.view(torch.int8)
    cache.view(-1, width).index_copy_(0, rows, values.to(cache.dtype))


def gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, workspace: Workspace,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One index_select per cache into reused buffers: [R, block_size, head_dim] each (an
    8-bit cache's rows dequantized to `dtype`)."""
    codes = k_cache.dtype
    if is_quantized(codes):  # selected as bytes (index_select takes no fp8)
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
    row_shape = k_cache.shape[2:]
    numel = rows.numel() * row_shape.numel()
    keys = workspace.get("k", numel, k_cache.dtype, k_cache.device).view(-1, *row_shape)
    values = workspace.get("v", numel, v_cache.dtype, v_cache.device).view(-1, *row_shape)
    if numel:
        torch.index_select(k_cache.view(-1, *row_shape), 0, rows, out=keys)
        torch.index_select(v_cache.view(-1, *row_shape), 0, rows, out=values)
    if is_quantized(codes):
        assert dtype is not None
        return (dequantize_rows(keys.view(codes), dtype),
                dequantize_rows(values.view(codes), dtype))
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
    use_matmul: bool, window: int | None = None, softcap: float | None = None,
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
    bias = decode_bias(bucket, torch.float32 if use_matmul else q.dtype, window)
    if use_matmul:
        attended = attend_matmul(query, key_seg, value_seg, bias, scale, target, softcap)
    else:
        attended = attend_sdpa(query, key_seg, value_seg, bias, scale, target)
    if in_place:
        return
    attended = attended.view(n, num_heads, head_dim)
    if bucket.row_range is not None:
        out[bucket.row_range[0]:bucket.row_range[1]] = attended
    else:
        out.index_copy_(0, bucket.rows, attended)


def decode_bias(bucket: DecodeBucket, dtype: torch.dtype, window: int | None) -> torch.Tensor:
    """0 / -inf over the bucket's keys: inside each context, and its last `window` tokens."""
    if window is None:
        return additive_mask(bucket.visible, dtype, bucket.biases)
    if (window, dtype) not in bucket.window_biases:
        lens = bucket.visible.sum(-1, keepdim=True)
        positions = torch.arange(bucket.visible.shape[-1], device=lens.device)
        in_window = bucket.visible & (positions >= lens - window)
        bucket.window_biases[window, dtype] = additive_mask(in_window, dtype, {})
    return bucket.window_biases[window, dtype]


def attend_matmul(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
    scale: float, out: torch.Tensor | None, softcap: float | None = None,
) -> torch.Tensor:
    """Explicit matmul -> (soft cap) -> fp32 masked softmax -> matmul (`bias` in fp32)."""
    scores = torch.matmul(query * scale, keys.transpose(2, 3)).float()
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = scores.add_(bias)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    if out is None:
        return torch.matmul(probs, values)
    return torch.matmul(probs, values, out=out)


def attend_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
    scale: float, out: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA's fused CPU kernel converts bf16 tiles itself: the choice without native bf16
    (`bias` in the query's dtype)."""
    attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scale)
    return attended if out is None else out.copy_(attended)


def prefill_fresh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, chunk: PrefillChunk,
    scale: float, window: int | None = None, softcap: float | None = None,
) -> None:
    """No cached prefix: causal attention over the chunk's own K/V (banded by a window
    shorter than the chunk)."""
    rows = slice(chunk.start, chunk.end)
    length = chunk.end - chunk.start
    mask = None
    if window is not None and window < length:
        positions = torch.arange(length, device=q.device)
        offsets = positions[:, None] - positions[None, :]
        mask = (offsets >= 0) & (offsets < window)
    if softcap is not None:
        if mask is None:
            mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril_()
        out[rows] = softcapped_attention(q[rows], k[rows], v[rows], mask, scale, softcap)
        return
    attended = F.scaled_dot_product_attention(
        heads_first(q[rows]), heads_first(k[rows]).to(q.dtype), heads_first(v[rows]).to(q.dtype),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    out[rows] = attended[0].transpose(0, 1)


def prefill_on_cache(
    q: torch.Tensor, out: torch.Tensor, chunk: PrefillChunk, keys: torch.Tensor | None,
    values: torch.Tensor | None, start: int, num_kv_heads: int, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> None:
    """New tokens on cached ones: attend the gathered context under a causal-offset mask."""
    assert chunk.block_ids is not None and chunk.mask is not None
    assert keys is not None and values is not None
    rows, num_blocks = slice(chunk.start, chunk.end), chunk.block_ids.numel()
    key_seg = segment(keys, start, 1, num_kv_heads, num_blocks, q.dtype)
    value_seg = segment(values, start, 1, num_kv_heads, num_blocks, q.dtype)
    if softcap is not None:
        visible = prefill_bias(chunk, torch.float32, window) == 0
        out[rows] = softcapped_attention(
            q[rows], key_seg[0, :, :chunk.seq_len].transpose(0, 1),
            value_seg[0, :, :chunk.seq_len].transpose(0, 1), visible, scale, softcap)
        return
    attended = F.scaled_dot_product_attention(
        heads_first(q[rows]), key_seg[:, :, :chunk.seq_len], value_seg[:, :, :chunk.seq_len],
        attn_mask=prefill_bias(chunk, q.dtype, window), scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )
    out[rows] = attended[0].transpose(0, 1)


def prefill_bias(chunk: PrefillChunk, dtype: torch.dtype, window: int | None) -> torch.Tensor:
    """0 / -inf over the chunk's context: causal, and each query's last `window` tokens."""
    assert chunk.mask is not None
    if window is None:
        return additive_mask(chunk.mask, dtype, chunk.biases)
    if (window, dtype) not in chunk.window_biases:
        query_len = chunk.end - chunk.start
        device = chunk.mask.device
        positions = torch.arange(chunk.seq_len - query_len, chunk.seq_len, device=device)
        keys = torch.arange(chunk.seq_len, device=device)
        in_window = chunk.mask & (keys[None, :] > positions[:, None] - window)
        chunk.window_biases[window, dtype] = additive_mask(in_window, dtype, {})
    return chunk.window_biases[window, dtype]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         visible: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """q [L, H, D], k and v [S, H_kv, D], visible [L, S]: explicit attention with scores
    soft-capped (which SDPA cannot do), softmax in fp32 -> [L, H, D]."""
    group = q.shape[1] // k.shape[1]
    keys = heads_first(k).repeat_interleave(group, dim=1).to(q.dtype)
    values = heads_first(v).repeat_interleave(group, dim=1).to(q.dtype)
    scores = torch.matmul(heads_first(q) * scale, keys.transpose(2, 3)).float()
    scores = torch.tanh(scores / softcap).mul_(softcap).masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values)[0].transpose(0, 1)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D]: SDPA's fused CPU kernel only takes 4-D inputs."""
    return x.transpose(0, 1).unsqueeze(0)
