"""A C++/OpenMP kernel for 4-bit weights times activations quantized to 8 bits per group of
32 as they arrive (`kernels/cpu/w4a8_matmul.cpp`): llama.cpp's Q4 x Q8_1 product, integer dot
products within a group (AVX2 `maddubs`), fp32 between groups. It reads the same packed codes,
scales and offsets as the fp32 int4 kernel (engine.kernels.int4_matmul) and answers to float
math on the dequantized weight and the fake-quantized activations (`fake_quantize_groups`).
Built once by `engine.kernels.build`; when it cannot be built, the layer multiplies its fp32
copy by the fake-quantized activations instead.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.build import I64, INT, PTR, load_library
from engine.kernels.int4_matmul import run_codes_kernel

GROUP = 32  # input channels per weight scale and per activation scale


def kernel_serves(device: torch.device, dtype: torch.dtype, group_size: int) -> bool:
    """fp32 activations on the CPU, weight groups of 32, and a kernel that builds here."""
    return (device.type == "cpu" and dtype == torch.float32 and group_size == GROUP
            and load_w4a8_kernel() is not None)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a int8 [rows, k], d float32 [rows, k / 32]) with x ≈ a·d per group of 32:
    d = max|x| / 127, a = round-half-even(x / d); a group of zeros has d = 0 and codes 0."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    scale = groups.abs().amax(dim=-1) / 127
    codes = torch.where(scale[..., None] > 0, torch.round(groups / scale[..., None]), 0)
    return codes.to(torch.int8).reshape(x.shape), scale


def fake_quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: a·d in float32, any leading shape."""
    flat = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_groups(flat)
    grouped = codes.float().reshape(flat.shape[0], -1, GROUP) * scale[..., None]
    return grouped.reshape(x.shape)


def run_w4a8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """x fp32 [rows, k], quantized per group, times W = q·s + o transposed (the int4 fp32
    kernel's arguments: engine.kernels.int4_matmul.pack_nibbles)."""
    library = load_w4a8_kernel()
    assert library is not None
    return run_codes_kernel("w4a8", library.loom_w4a8_matmul, x, codes, scales, offsets)


def kernel_quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales the kernel itself computes (what `quantize_groups` must equal)."""
    library = load_w4a8_kernel()
    assert library is not None
    x = x.float().contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty((x.shape[0], x.shape[1] // GROUP), dtype=torch.float32)
    if library.loom_w4a8_quantize(x.data_ptr(), x.shape[0], x.shape[1], codes.data_ptr(),
                                  scales.data_ptr()) != 0:
        raise ValueError(f"w4a8: cannot quantize x {tuple(x.shape)} in groups of {GROUP}")
    return codes, scales


@functools.cache
def load_w4a8_kernel() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernel; None, logged, when that fails."""
    return load_library("w4a8_matmul", "the fp32 copy", {
        "loom_w4a8_matmul": ([PTR, I64, PTR, PTR, PTR, PTR, I64, I64, INT], ctypes.c_int),
        "loom_w4a8_quantize": ([PTR, I64, I64, PTR, PTR], ctypes.c_int)})
