"""The model's one boundary to the paged KV cache: each attention layer hands its q, k, v to
the step's backend and metadata, which the model runner sets in the forward context."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.forward_context import StepGaveWay, current_context
from engine.attention.key_smoothing import KeySmoothing, KeyStatistics
from engine.attention.op import paged_attention_op


class PagedAttention(nn.Module):
    def __init__(self, scale: float, window: int | None = None,
                 softcap: float | None = None) -> None:
        """`window`: a sliding-window layer's (each query sees its last `window` tokens);
        `softcap`: its scores' soft cap (Gemma 2)."""
        super().__init__()
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.kv_group = 0  # its KV cache group, whose block tables it reads (set by the runner)
        # An 8-bit cache's (engine.attention.key_smoothing), set by the runner; statistics
        # gathers what they are made of while it calibrates.
        self.key_smoothing: KeySmoothing | None = None
        self.statistics: KeyStatistics | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [T, heads, D], k and v [T, kv_heads, D] -> [T, heads, D]. Rows past the step's
        tokens (the runner's padding, engine.layers.batch_invariant) attend nothing and come
        out 0."""
        if self.statistics is not None:
            self.statistics.observe(q, k)
        if self.key_smoothing is not None:
            q, k = self.key_smoothing.apply(q, k)
        context = current_context()
        if context.give_way is not None and context.give_way():
            raise StepGaveWay
        metadata = context.metadata(self.kv_group)
        tokens = metadata.slot_mapping.shape[0]
        if q.shape[0] == tokens:
            return context.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata,
                                           self.scale, self.window, self.softcap)
        out = q.new_zeros(q.shape)
        out[:tokens] = context.backend.forward(q[:tokens], k[:tokens], v[:tokens], kv_cache[0],
                                               kv_cache[1], metadata, self.scale, self.window,
                                               self.softcap)
        return out

    def forward_as_op(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The same through `loom::paged_attention`, which torch.compile keeps opaque."""
        if self.key_smoothing is not None:
            q, k = self.key_smoothing.apply(q, k)
        return paged_attention_op(q, k, v, kv_cache[0], kv_cache[1], self.scale,
                                  self.window or 0, self.softcap or 0.0, self.kv_group)

    def trace_as_op(self) -> None:
        self.forward = self.forward_as_op
