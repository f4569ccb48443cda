"""No quantization: the float weight, in the form this device multiplies fastest.

On a CPU with native bf16 (AVX512-BF16 or AMX), oneDNN multiplies a bf16 weight that it has
reordered into its own blocked layout faster than `F.linear` on the plain weight (the reorder
otherwise happens inside every call), with bit-identical results (docs/benchmarks.md).
`prepack_linears` puts a `PackedLinear` in every linear's place where that holds.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.platform.cpu import native_bf16_matmul
from engine.quantization.replace import replace_linears


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and native_bf16_matmul()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (bf16, CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [],
                                                  "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def prepack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Puts packed linears in the model's float ones' places where that pays; returns how
    many. A tied output projection gets a packed copy of the embedding (see replace_linears)."""
    if not packing_applies(device, dtype):
        return 0
    return len(replace_linears(model, PackedLinear))
