"""SiLU(gate) * up over a merged gate/up projection: one C++ pass on the CPU
(engine/kernels/cpu/elementwise.cpp), torch ops elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.elementwise import load_elementwise, run_silu_and_mul
from engine.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """[..., 2 * width] -> [..., width]: silu(first half) * second half."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
        run_silu_and_mul(load_elementwise(), gate_up, out)
        return out


class GeluTanhAndMul(CustomOp):
    """[..., 2 * width] -> [..., width]: gelu_tanh(first half) * second half (Gemma)."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> CustomOp:
    """The gated MLP's activation layer for a config's `hidden_act`."""
    return GeluTanhAndMul() if name == "gelu_pytorch_tanh" else SiluAndMul()
