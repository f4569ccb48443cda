"""Attention over the paged cache the slow, obvious way: what every backend is tested against."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata, cache_rows
from engine.attention.quantized_kv import dequantize_rows, is_quantized, rotate
from engine.attention.torch_backend import write_cache_rows


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, num_kv_heads, head_dim] into their slots, one indexed copy per cache (an
    8-bit cache's rows rotated, as attention writes them)."""
    rows = cache_rows(slot_mapping, k_cache.shape[2], k_cache.shape[1])
    if is_quantized(k_cache.dtype):
        k, v = rotate(k), rotate(v)
    write_cache_rows(k, k_cache, rows)
    write_cache_rows(v, v_cache, rows)


def cache_values(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values a cache holds, [num_blocks, H, block_size, head_dim] in `dtype`."""
    return dequantize_rows(cache, dtype) if is_quantized(cache.dtype) else cache.to(dtype)


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    metadata: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Straightforward per-request attention over the paged cache: slow, obviously right.
    With a `window`, query i sees key j when i - j < window (transformers' sliding window);
    with a `softcap`, scaled scores s become softcap * tanh(s / softcap). An 8-bit cache
    holds rotated rows: the query and the output are rotated too."""
    if is_quantized(k_cache.dtype):
        return rotate(reference_attention(rotate(q), cache_values(k_cache, q.dtype),
                                          cache_values(v_cache, q.dtype), metadata, scale,
                                          window, softcap))
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
        offsets = positions[:, None] - torch.arange(seq_len, device=q.device)[None, :]
        mask = (offsets >= 0) & (offsets < (window or seq_len + 1))
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=0).to(q.dtype)
        values = values.repeat_interleave(group, dim=0).to(q.dtype)
        scores = (query @ keys.transpose(1, 2)).float() * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[start:end] = (probs.to(q.dtype) @ values).transpose(0, 1)
    return out
