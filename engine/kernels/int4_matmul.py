"""A C++/OpenMP kernel for 4-bit weights and fp32 activations on the CPU
(`kernels/cpu/int4_matmul.cpp`): y = x Wᵀ reading the codes as they are (half a byte a
weight, fp32 math; a row's sums in one order whatever shares the call). torch's own int4
kernel is fast only on bf16 activations; in an fp32 model this one serves the decode steps.
Built once by `engine.kernels.build`; when it cannot be built, the layer multiplies its fp32
copy instead.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from engine.kernels.build import I64, INT, PTR, load_library

GROUP = 32  # input channels per scale and offset


def kernel_serves(device: torch.device, dtype: torch.dtype, group_size: int) -> bool:
    """fp32 activations on the CPU, groups of 32, and a kernel that builds here."""
    return (device.type == "cpu" and dtype == torch.float32 and group_size == GROUP
            and load_int4_kernel() is not None)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [n, k] in 0..15 as the kernel reads it: [n, k / 2] bytes, in each group of 32 byte b
    holding code b (low nibble) and code b + 16 (high)."""
    n, k = q.shape
    groups = q.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`."""
    n, half = packed.shape
    groups = packed.reshape(n, -1, GROUP // 2)
    return torch.stack([groups & 15, groups >> 4], dim=2).reshape(n, half * 2)


def run_int4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """x fp32 [rows, k] times W = q·s + o transposed: codes as `pack_nibbles`
    makes them, scales and offsets fp32 [n, k / 32], all contiguous CPU tensors."""
    library = load_int4_kernel()
    assert library is not None
    return run_codes_kernel("int4", library.loom_int4_matmul, x, codes, scales, offsets)


def run_codes_kernel(name: str, kernel: Callable[..., int], x: torch.Tensor,
                     codes: torch.Tensor, scales: torch.Tensor,
                     offsets: torch.Tensor) -> torch.Tensor:
    """Calls a kernel taking (x, rows, codes, scales, offsets, y, n, k, threads) as the int4
    and w4a8 ones do, its arguments checked first; y [rows, n] fp32."""
    x = x.contiguous()
    n, k = codes.shape[0], codes.shape[1] * 2
    if (x.dtype != torch.float32 or x.shape[1] != k or x.shape[0] < 1
            or scales.shape != (n, k // GROUP) or offsets.shape != scales.shape):
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} against codes "
                         f"{tuple(codes.shape)}, scales {tuple(scales.shape)}")
    y = x.new_empty((x.shape[0], n))
    status = kernel(x.data_ptr(), x.shape[0], codes.data_ptr(), scales.data_ptr(),
                    offsets.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the {name} kernel refused its arguments ({status})")
    return y


@functools.cache
def load_int4_kernel() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernel; None, logged, when that fails."""
    return load_library("int4_matmul", "the fp32 copy", {
        "loom_int4_matmul": ([PTR, I64, PTR, PTR, PTR, PTR, I64, I64, INT], ctypes.c_int)})
