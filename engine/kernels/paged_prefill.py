"""Tiled prefill attention (`kernels/cpu/paged_prefill.cpp`): each chunk's queries, 16 rows at
a time, over their causal context read in place from the paged bf16 cache, as flash attention
(online softmax in fp32), the products on AMX tiles where the CPU has them (and Linux permits
them) and in AVX512-BF16 vectors elsewhere. `LOOM_CPU_AMX=0` keeps it off the tiles;
`LOOM_CPU_TILED_PREFILL=0` turns it off (every chunk then runs as rows of the decode kernel).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from engine.kernels.build import FLOAT, I64, INT, PTR, kernel_enabled, load_library

if TYPE_CHECKING:
    from engine.attention.metadata import PrefillBatch
    from engine.attention.workspace import Workspace

PREFILL_STEP_KEYS = 32  # the kernel pads each chunk's keys to this in its V^T scratch


def tiled_prefill_supports(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """bf16 caches, head_dim a multiple of 32 up to 256, blocks of whole 16-token tiles, and
    a kernel that builds here (AMX tiles or AVX512-BF16)."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
            and block_size % 16 == 0 and kernel_enabled("LOOM_CPU_TILED_PREFILL")
            and prefill_kind() > 0)


def prefill_on_tiles() -> bool:
    """The kernel's products on AMX tiles (else in vector registers)."""
    return prefill_kind() == 2 and kernel_enabled("LOOM_CPU_AMX")


def run_paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PrefillBatch,
    scale: float, out: torch.Tensor, workspace: Workspace, window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Rows of `batch`'s chunks of q [T, H, D] into the same rows of out [T, H, D]."""
    kernel = load_cpp_prefill()
    assert kernel is not None
    if not q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16:
        raise TypeError(f"tiled prefill of {q.dtype} queries over {k_cache.dtype} caches")
    if batch.max_block >= k_cache.shape[0]:  # the kernel reads blocks without bounds checks
        raise IndexError(f"block {batch.max_block} is outside a cache of {k_cache.shape[0]}")
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    num_kv_heads, block_size, head_dim = k_cache.shape[1:]
    padded = sum(-(-n // PREFILL_STEP_KEYS) * PREFILL_STEP_KEYS for n in batch.seq_len_list)
    values_t = workspace.get("values_t", num_kv_heads * head_dim * padded, torch.bfloat16,
                             q.device)
    tables = batch.block_tables
    status = kernel(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), batch.q_starts.data_ptr(), batch.query_lens.data_ptr(),
        batch.seq_lens.data_ptr(), batch.size, q.shape[1], num_kv_heads, block_size, head_dim,
        scale, window or 0, softcap or 0.0, values_t.data_ptr(), values_t.numel(),
        int(prefill_on_tiles()), out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"tiled prefill kernel refused its arguments ({status})")


@functools.cache
def prefill_library() -> ctypes.CDLL | None:
    """The built kernel library (None, with one warning, where it cannot be built)."""
    return load_library("paged_prefill", "the decode kernel's rows", {
        "loom_prefill_kind": ([], ctypes.c_int),
        "loom_paged_prefill": ([PTR, I64, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64, I64, I64, I64,
                                I64, FLOAT, I64, FLOAT, PTR, I64, INT, PTR, INT], ctypes.c_int),
    })


@functools.cache
def prefill_kind() -> int:
    """2: AMX tiles or vectors; 1: AVX512-BF16 vectors only; 0: no kernel here."""
    library = prefill_library()
    return 0 if library is None else library.loom_prefill_kind()


def load_cpp_prefill() -> ctypes._CFuncPtr | None:
    """The kernel, or None where it cannot be built or the CPU has neither AMX nor
    AVX512-BF16."""
    return prefill_library().loom_paged_prefill if prefill_kind() else None
