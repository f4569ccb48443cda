"""`loom::paged_attention`: the step's attention as one opaque torch op, so a compiled forward
keeps its graph whole around it; it runs the backend of the forward context eagerly."""

from __future__ import annotations

import torch

from engine.attention.forward_context import current_context


@torch.library.custom_op("loom::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float, window: int, softcap: float, group: int,
) -> torch.Tensor:
    """`window`, `softcap` 0: none; `group`: the layer's KV cache group."""
    context = current_context()
    return context.backend.forward(q, k, v, k_cache, v_cache, context.metadata(group), scale,
                                   window or None, softcap or None)


@paged_attention_op.register_fake
def _paged_attention_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float, window: int, softcap: float, group: int,
) -> torch.Tensor:
    return torch.empty_like(q)
