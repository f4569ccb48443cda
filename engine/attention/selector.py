"""The attention backend, chosen once at start-up from device, dtype, CPU and model shape.

CUDA with triton installed (and power-of-two head dim and block size): Triton. A CPU where
our C++ kernel builds and fits the heads: the C++ backend (with the tiled prefill kernel for
bf16 caches where the CPU has AMX or AVX512-BF16; 8-bit caches too). Anything else: torch ops.
`LOOM_TRITON_ATTENTION=0` and `LOOM_CPP_DECODE=0` rule a kernel out (to compare, or to work
around one).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.attention.cpu_backend import CpuBackend
from engine.attention.quantized_kv import is_quantized
from engine.attention.torch_backend import TorchBackend, decode_kernel_for
from engine.attention.triton_backend import TritonBackend
from engine.kernels.build import kernel_enabled
from engine.kernels.paged_prefill import tiled_prefill_supports


def select_attention_backend(device: torch.device, dtype: torch.dtype, num_heads: int,
                             num_kv_heads: int, head_dim: int, block_size: int,
                             batch_invariant: bool = False,
                             cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """`num_heads`, `num_kv_heads`: this process's share of the model's heads.
    `batch_invariant`: every query row through the C++ kernel, or a ValueError saying why
    that cannot be here. `cache_dtype`: the KV cache's (engine.attention.quantized_kv;
    default: the model's)."""
    cache_dtype = cache_dtype or dtype
    cpp = kernel_enabled("LOOM_CPP_DECODE") and CpuBackend.supports(
        device, dtype, num_heads, num_kv_heads, head_dim, cache_dtype)
    if batch_invariant:
        if not cpp:
            raise ValueError(
                f"--batch-invariant needs Loom's C++ attention kernel: a CPU, float32 or "
                f"bfloat16, head_dim <= 256 and <= 16 query heads "
                f"per KV head (here: "
                f"{device.type}, {dtype}, head_dim {head_dim}, {num_heads} / {num_kv_heads} "
                f"heads){'' if device.type == 'cpu' else '; the GPU path offers no such mode'}")
        return CpuBackend(block_size, num_kv_heads, rows_only=True)
    if kernel_enabled("LOOM_TRITON_ATTENTION") and not is_quantized(cache_dtype) \
            and TritonBackend.supports(device, head_dim, block_size):
        return TritonBackend(block_size, num_kv_heads)
    if cpp:
        return CpuBackend(block_size, num_kv_heads,
                          tiled_prefill_supports(cache_dtype, head_dim, block_size))
    return TorchBackend(block_size, num_kv_heads, decode_kernel_for(device, dtype))

