"""Attention over the paged cache the slow, obvious way: what every backend is tested against."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata, cache_rows


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, num_kv_heads, head_dim] into their slots, one indexed copy per cache."""
    rows = cache_rows(slot_mapping, k_cache.shape[2], k_cache.shape[1])
    head_dim = k_cache.shape[-1]
    k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(v_cache.dtype))


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    metadata: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Straightforward per-request attention over the paged cache: slow, obviously right.
    With a `window`, query i sees key j when i - j < window (transformers' sliding window);
    with a `softcap`, scaled scores s become softcap * tanh(s / softcap)."""
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
