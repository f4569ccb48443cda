"""Linear layers in the form this device multiplies fastest, chosen once at load time.

On a CPU with native bf16 (AVX512-BF16 or AMX), oneDNN multiplies a bf16 weight that it has
reordered into its own blocked layout 1.3-2.5x faster than `F.linear` on the plain weight (the
reorder otherwise happens inside every call), with bit-identical results. `prepack_linears`
swaps every `nn.Linear` of a model (and the tied output projection) for a `PackedLinear` where
that holds; the model code keeps calling its modules as before.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.opaque_linear import register_opaque_linear
from engine.platform.cpu import native_bf16_matmul


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and native_bf16_matmul()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (bf16, CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()
        self.handle = register_opaque_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.loom.linear(x, self.handle)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [],
                                                  "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def prepack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replaces the model's linear layers by packed ones where that pays; returns how many.

    A model whose output projection is tied to its embedding (`lm_head is None`) gets a packed
    copy of the embedding as its `lm_head`: the embedding itself stays for the lookup."""
    if not packing_applies(device, dtype):
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += 1
    if getattr(model, "lm_head", ()) is None:
        model.lm_head = PackedLinear(model.model.embed_tokens.weight, None)
        count += 1
    return count
