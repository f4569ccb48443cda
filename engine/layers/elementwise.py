"""The decoder's elementwise ops behind one boundary: RMSNorm (optionally adding the residual
first, as vLLM's fused_add_rms_norm does), SiLU(gate) * up, and rotary position embeddings.

Eager on the CPU they run as one C++ pass each (`engine.kernels.elementwise`); while
torch.compile traces, on other devices, or where the kernels cannot build, they are plain
torch ops, which inductor fuses by itself. `LOOM_CPP_ELEMENTWISE=0` turns the kernels off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.kernels.build import kernel_supports
from engine.kernels.elementwise import (
    load_elementwise,
    rows_of_contiguous_heads,
    run_add_rms_norm,
    run_rotary,
    run_silu_and_mul,
)

CPP_ELEMENTWISE = os.environ.get("LOOM_CPP_ELEMENTWISE", "1") != "0"


def _kernels_apply(*tensors: torch.Tensor) -> bool:
    return (CPP_ELEMENTWISE and not torch.compiler.is_compiling() and kernel_supports(*tensors)
            and load_elementwise() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _kernels_apply(x, weight):
        out = torch.empty_like(x)
        run_add_rms_norm(load_elementwise(), x, None, weight, eps, out)
        return out
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual). Eager on the CPU both are written in place: x gets
    the normed rows and residual the sum, so pass tensors the caller no longer needs."""
    if _kernels_apply(x, residual, weight):
        run_add_rms_norm(load_elementwise(), x, residual, weight, eps, x)
        return x, residual
    residual = x + residual
    return F.rms_norm(residual, weight.shape, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * width] -> [..., width]: silu(first half) * second half."""
    width = gate_up.shape[-1] // 2
    if _kernels_apply(gate_up):
        out = gate_up.new_empty((*gate_up.shape[:-1], width))
        run_silu_and_mul(load_elementwise(), gate_up, out)
        return out
    gate, up = gate_up.split(width, dim=-1)
    return F.silu(gate) * up


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Half-split (GPT-NeoX / HF) rotary on x [T, heads, D]; cos, signed_sin [T, 1, D], the
    sign of rotate_half folded into signed_sin. Eager on the CPU x is rotated in place (its
    heads may be a slice of a wider row, such as the q and k parts of a fused qkv output)."""
    if _kernels_apply(cos, signed_sin) and x.dtype == cos.dtype and x.device.type == "cpu" \
            and rows_of_contiguous_heads(x):
        run_rotary(load_elementwise(), x, cos, signed_sin)
        return x
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
