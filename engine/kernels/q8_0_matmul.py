"""A C++/OpenMP kernel for Q8_0 weights on the CPU (`kernels/cpu/q8_0_matmul.cpp`; GGUF's
8-bit type: blocks of 32 int8 codes with one scale each, W = q·d): y = x Wᵀ, reading the
codes as they are (each channel's codes once for every 4 rows of x; a row's sums in one order
whatever shares the call). A decode step is memory-bound, so reading 1.1 bytes a
weight instead of bf16's 2 is the whole gain; products and sums stay in fp32, so the result
is float math on the dequantized weight. Built once by `engine.kernels.build`; when it
cannot be built, the layer multiplies its dequantized weight instead.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.build import I64, INT, PTR, load_library

Q8_BLOCK = 32
BLOCKS = (16, 32)  # input channels per scale: Q8_0 and Q5_0 blocks, Q6_K's sub-blocks
TILE = 16  # output channels a tile of the tiled layout


def kernel_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 or bf16 activations on the CPU, and a kernel that builds here."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and load_q8_kernel() is not None)


def run_q8_0_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, k] (bf16 or fp32, contiguous) times the int8 weight transposed:
    codes int8 [n, k], scales float32 [n, k / block] (block 32 or 16), both contiguous CPU
    tensors."""
    library = load_q8_kernel()
    assert library is not None
    x = x.contiguous()
    n, k = codes.shape
    block = k // scales.shape[1]
    if x.shape[1] != k or scales.shape != (n, k // block) or block not in BLOCKS:
        raise ValueError(f"Q8_0: x {tuple(x.shape)} against codes {tuple(codes.shape)} "
                         f"and scales {tuple(scales.shape)}")
    y = x.new_empty((x.shape[0], n))
    status = library.loom_q8_0_matmul(int(x.dtype is torch.bfloat16), x.data_ptr(), x.shape[0],
                                      codes.data_ptr(), scales.data_ptr(), y.data_ptr(), n, k,
                                      block, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the Q8_0 kernel refused its arguments ({status})")
    return y


def tiles_serve(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 activations on a CPU that multiplies bf16 pairs (AVX512-BF16): the tiled kernel."""
    library = load_q8_kernel() if device.type == "cpu" and dtype is torch.bfloat16 else None
    return library is not None and bool(library.loom_q8_0_tiles_built())


def tiled(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [n, k] and scales [n, k / block] in the tiled kernel's layout: codes [n / 16,
    k / 2, 16, 2] (a tile's 16 channels' codes for each pair of inputs side by side), scales
    [n / 16, k / block, 16]; n padded with zero channels to whole tiles."""
    n, k = codes.shape
    pad = -n % TILE
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    scales = torch.nn.functional.pad(scales, (0, 0, 0, pad))
    tiles = (n + pad) // TILE
    return (codes.view(tiles, TILE, k // 2, 2).transpose(1, 2).contiguous(),
            scales.view(tiles, TILE, -1).transpose(1, 2).contiguous())


def untiled(codes: torch.Tensor, scales: torch.Tensor, n: int,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`tiled`'s inverse: codes [n, k] and scales [n, k / block]."""
    tiles, half_k = codes.shape[:2]
    return (codes.transpose(1, 2).reshape(tiles * TILE, 2 * half_k)[:n],
            scales.transpose(1, 2).reshape(tiles * TILE, -1)[:n])


def run_q8_0_tiles(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   n: int) -> torch.Tensor:
    """x [rows, k] bf16 times the int8 weight of `n` channels in the tiled layout
    (`tiled`), transposed: bf16 [rows, n]."""
    library = load_q8_kernel()
    assert library is not None
    x = x.contiguous()
    k = 2 * codes.shape[1]
    block = k // scales.shape[1]
    if x.dtype is not torch.bfloat16 or x.shape[1] != k or block not in BLOCKS:
        raise ValueError(f"Q8_0 tiles: x {tuple(x.shape)} {x.dtype} against codes "
                         f"{tuple(codes.shape)} and scales {tuple(scales.shape)}")
    y = x.new_empty((x.shape[0], n))
    status = library.loom_q8_0_tiles(x.data_ptr(), x.shape[0], codes.data_ptr(),
                                     scales.data_ptr(), y.data_ptr(), n, k, block,
                                     torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the tiled Q8_0 kernel refused its arguments ({status})")
    return y


@functools.cache
def load_q8_kernel() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernel; None, logged, when that fails."""
    return load_library("q8_0_matmul", "the dequantized weight", {
        "loom_q8_0_matmul": ([INT, PTR, I64, PTR, PTR, PTR, I64, I64, I64, INT],
                             ctypes.c_int),
        "loom_q8_0_tiles": ([PTR, I64, PTR, PTR, PTR, I64, I64, I64, INT], ctypes.c_int),
        "loom_q8_0_tiles_built": ([], ctypes.c_int)})
