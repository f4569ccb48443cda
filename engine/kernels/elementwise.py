"""C++/OpenMP kernels for the decoder's elementwise ops on the CPU (`kernels/cpu/
elementwise.cpp`), fp32 or bf16, math in fp32: RMSNorm with the residual add fused in,
SiLU(gate) * up, and rotary embeddings in place. One pass over each row instead of several
torch ops (and their temporaries); built by `engine.kernels.build`, loaded through ctypes.
The layers' `forward_cpu` (engine.layers.norm, rotary, activation) call them.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.build import FLOAT, I64, INT, PTR, load_library


@functools.cache
def load_elementwise() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernels; None, logged, when that fails."""
    return load_library("elementwise", "torch ops", {
        "loom_add_rms_norm": ([INT, PTR, PTR, PTR, PTR, I64, I64, FLOAT, INT], None),
        "loom_silu_and_mul": ([INT, PTR, PTR, I64, I64, INT], None),
        "loom_rotary": ([INT, PTR, I64, I64, I64, I64, PTR, PTR, INT], None),
    })


def rows_of_contiguous_heads(x: torch.Tensor) -> bool:
    """x [tokens, heads, dim] whose heads are back to back inside each token's row."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def run_add_rms_norm(library: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    hidden = x.shape[-1]
    library.loom_add_rms_norm(
        int(x.dtype == torch.bfloat16), x.data_ptr(),
        None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.numel() // hidden, hidden, eps, torch.get_num_threads())


def run_rotary(library: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor,
               signed_sin: torch.Tensor) -> None:
    tokens, heads, dim = x.shape
    library.loom_rotary(int(x.dtype == torch.bfloat16), x.data_ptr(), x.stride(0), tokens, heads,
                        dim, cos.data_ptr(), signed_sin.data_ptr(), torch.get_num_threads())


def run_silu_and_mul(library: ctypes.CDLL, gate_up: torch.Tensor, out: torch.Tensor) -> None:
    width = out.shape[-1]
    library.loom_silu_and_mul(int(gate_up.dtype == torch.bfloat16), gate_up.data_ptr(),
                              out.data_ptr(), out.numel() // width, width,
                              torch.get_num_threads())
