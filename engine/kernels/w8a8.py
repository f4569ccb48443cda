"""C++/OpenMP passes around w8a8's int8 GEMM on the CPU (`kernels/cpu/w8a8.cpp`, for
engine.quantization.w8a8.W8A8Linear): quantizing activations per token, and scaling the int32
products back to float, each one pass over the data where torch needed several ops and
temporaries. Both compute exactly what the torch ops compute (same divisions, same rounding,
same order of products), so the layer still answers to float math on its fake-quantized
activations. And the int8 GEMM itself where oneDNN has no int8 instructions to use (no VNNI,
no AMX: `torch._int_mm` then runs at ~2-3 G products/s, 1.5 ms for one 576 x 3,072 product at
one row): integer sums, so the same int32 products exactly. Built by `engine.kernels.build`,
loaded through ctypes; without them the layer uses the torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.build import I64, INT, PTR, load_library
from engine.platform.cpu import cpu_flags

# CPU flags with which oneDNN's int8 GEMM (`torch._int_mm`) has int8 dot-product instructions.
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def kernels_serve(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 or bf16 activations on the CPU, and kernels that build here."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and load_w8a8_kernels() is not None)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a int8 [M, K], t float32 [M, 1]) with x ≈ a·t, as W8A8Linear.quantize_input."""
    library = load_w8a8_kernels()
    assert library is not None
    rows, k = x.shape
    codes = torch.empty((rows, k), dtype=torch.int8)
    scales = torch.empty((rows, 1), dtype=torch.float32)
    library.loom_quantize_rows(int(x.dtype is torch.bfloat16), x.data_ptr(), rows, k,
                               codes.data_ptr(), scales.data_ptr(), torch.get_num_threads())
    return codes, scales


@functools.cache
def gemm_serves() -> bool:
    """Whether our int8 GEMM replaces `torch._int_mm` here: kernels built, no int8 dot-product
    instructions for oneDNN."""
    return load_w8a8_kernels() is not None and not cpu_flags() & INT8_DOT_FLAGS


def int8_matmul(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(a, weight.T), bit for bit: a int8 [M, K] with codes in -127..127 (as
    `quantize_rows` makes them), weight int8 [N, K] contiguous; int32 [M, N]."""
    library = load_w8a8_kernels()
    assert library is not None
    a = a.contiguous()
    if (a.dtype is not torch.int8 or weight.dtype is not torch.int8 or a.dim() != 2
            or not weight.is_contiguous() or a.shape[1] != weight.shape[1]):
        raise ValueError(f"int8 matmul: a {tuple(a.shape)} {a.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    out = torch.empty((a.shape[0], weight.shape[0]), dtype=torch.int32)
    library.loom_int8_matmul(a.data_ptr(), a.shape[0], weight.data_ptr(), out.data_ptr(),
                             weight.shape[0], weight.shape[1], torch.get_num_threads())
    return out


def rescale(acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """(acc.float() * row_scales * col_scales).to(dtype): acc int32 [M, N] contiguous,
    row_scales float32 [M, 1], col_scales float32 [N]."""
    library = load_w8a8_kernels()
    assert library is not None
    rows, n = acc.shape
    if not (acc.dtype is torch.int32 and acc.is_contiguous() and row_scales.numel() == rows
            and col_scales.numel() == n and col_scales.dtype is torch.float32):
        raise ValueError(f"w8a8 rescale: acc {tuple(acc.shape)} {acc.dtype}, "
                         f"scales {tuple(row_scales.shape)} / {tuple(col_scales.shape)}")
    out = torch.empty((rows, n), dtype=dtype)
    library.loom_rescale(int(dtype is torch.bfloat16), acc.data_ptr(), rows, n,
                         row_scales.contiguous().data_ptr(), col_scales.data_ptr(),
                         out.data_ptr(), torch.get_num_threads())
    return out


@functools.cache
def load_w8a8_kernels() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernels; None, logged, when that fails."""
    return load_library("w8a8", "torch ops", {
        "loom_quantize_rows": ([INT, PTR, I64, I64, PTR, PTR, INT], None),
        "loom_rescale": ([INT, PTR, I64, I64, PTR, PTR, PTR, INT], None),
        "loom_int8_matmul": ([PTR, I64, PTR, PTR, I64, I64, INT], None),
    })
