"""Every routed expert's projection of one kind (gate/up or down) as one int4 weight, for the
grouped kernel (engine.kernels.moe_int4): no per-expert layers, no packed bf16 copies."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.moe_int4 import kernel_serves, pack_experts, run_moe_int4, unpack_experts
from engine.quantization.int4 import INT4_ZERO_POINT, Int4Linear


class Int4Experts(nn.Module):
    """y = x Wₑᵀ for each expert e's rows of x (rows grouped by expert, `counts` [E] of each)."""

    method = "int4"

    def __init__(self, experts: list[Int4Linear]) -> None:
        super().__init__()
        first = experts[0]
        self.out_features, self.in_features = first.out_features, first.in_features
        self.group_size = first.group_size
        if all(expert.grouped_blocks is not None for expert in experts):
            # Each expert already holds the kernel's layout (as a weight of one expert).
            blocks = torch.cat([expert.grouped_blocks for expert in experts])
        else:
            codes = torch.stack([expert.codes() for expert in experts])
            scales_and_zeros = torch.stack([expert.scales_and_zeros for expert in experts])
            blocks = pack_experts(codes, scales_and_zeros)
        self.register_buffer("blocks", blocks)
        self._args = (blocks,)

    @staticmethod
    def serve(layers: list[nn.Module]) -> bool:
        """Whether the grouped kernel serves these per-expert layers (bias-free int4 in bf16
        on the CPU, groups of 32, whole tiles)."""
        return all(isinstance(layer, Int4Linear) and layer.bias is None
                   and layer.device.type == "cpu"
                   and kernel_serves(layer.dense_dtype, layer.group_size,
                                     layer.out_features, layer.in_features)
                   for layer in layers)

    def dequantized_weight(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s (q - 8)·s + z in float32 [out, in], as Int4Linear's."""
        q, scales_and_zeros = unpack_experts(self.blocks[expert:expert + 1])
        scale, zero = (part.T.repeat_interleave(self.group_size, 1)
                       for part in scales_and_zeros[0].float().unbind(-1))
        return (q[0].float() - INT4_ZERO_POINT) * scale + zero

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run_moe_int4(x, counts, *self._args)

    def extra_repr(self) -> str:
        experts = self.blocks.shape[0]
        return (f"experts={experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, int4 grouped kernel")
