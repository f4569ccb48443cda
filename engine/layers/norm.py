"""RMSNorm, optionally adding the residual stream first (as vLLM's fused_add_rms_norm does):
one C++ pass per row on the CPU (engine/kernels/cpu/elementwise.cpp), torch ops elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.elementwise import load_elementwise, run_add_rms_norm
from engine.layers.custom_op import CustomOp
from engine.layers.linear import CheckpointTensor


class RMSNorm(CustomOp):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None,
                 weight_offset: float = 0.0) -> None:
        """`weight_offset`: the checkpoint's weight is the scale minus this (Gemma's norms
        scale by 1 + w); the layer holds the scale itself."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self.weight_offset = weight_offset

    def load(self, kind: str, tensor: CheckpointTensor, part: object) -> None:
        self.weight.data.copy_(tensor[:].float() + self.weight_offset)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        weight = self.weight
        if residual is None:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, weight.shape, weight, self.eps), residual

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With a residual, both are written in place: x gets the normed rows and residual
        the sum, so pass tensors the caller no longer needs."""
        x = x.contiguous()
        if residual is None:
            out = torch.empty_like(x)
            run_add_rms_norm(load_elementwise(), x, None, self.weight, self.eps, out)
            return out
        residual = residual.contiguous()
        run_add_rms_norm(load_elementwise(), x, residual, self.weight, self.eps, x)
        return x, residual
