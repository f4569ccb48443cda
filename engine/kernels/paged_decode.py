"""A small C++/OpenMP paged-decode kernel for the CPU (`kernels/cpu/paged_decode.cpp`): one
query token per request attends over its blocks in place (no gather), or a run of one
request's rows at consecutive positions (a decode and its drafts) over its blocks read once,
with an fp32 softmax (bf16 caches on a CPU with AMX: scores and weighted values as tile
products; `LOOM_CPU_AMX=0` keeps them in vector registers); and the step's KV write, one call
copying each new token's heads into their cache rows. 8-bit caches
(engine.attention.quantized_kv) are read as codes and scales (fp8 codes widened through
fp16), and int8 ones written quantized, by the same calls.
Built once by `engine.kernels.build` and loaded through ctypes; when it cannot be built,
attention falls back to its torch path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from engine.kernels.build import FLOAT, I64, INT, PTR, kernel_enabled, load_library

if TYPE_CHECKING:
    from engine.attention.metadata import DecodeBatch

CPP_MAX_GROUP, CPP_MAX_DIM = 16, 256
# The kernel's `codes` argument per 8-bit cache dtype.
CODE_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def run_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
    scale: float, out: torch.Tensor, window: int | None = None, softcap: float | None = None,
) -> None:
    """Each row attends its context's last `window` tokens (all of them without one), its
    scaled scores soft-capped at `softcap` where given."""
    library = load_cpp_library()
    assert library is not None
    codes = CODE_KINDS.get(k_cache.dtype, 0) if k_cache.dtype == v_cache.dtype else 0
    if not (codes or q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"paged decode of {q.dtype} queries over {k_cache.dtype} caches")
    if batch.max_block >= k_cache.shape[0]:  # the kernel reads blocks without bounds checks
        raise IndexError(f"block {batch.max_block} is outside a cache of {k_cache.shape[0]}")
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    tables = batch.block_tables
    runs = None if batch.runs is None else batch.runs.data_ptr()
    status = library.loom_paged_decode(
        int(q.dtype == torch.bfloat16), codes, q.data_ptr(), q.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), batch.lens.data_ptr(),
        batch.row_index.data_ptr(), batch.size, runs, batch.num_runs, q.shape[1],
        k_cache.shape[1], k_cache.shape[2], q.shape[2], scale, window or 0, softcap or 0.0,
        int(kernel_enabled("LOOM_CPU_AMX")), out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"paged decode kernel refused its arguments ({status})")


def run_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, rows: torch.Tensor, max_row: int) -> None:
    """`write_kv_rows` as one C++ call: k, v [T, H, D] with each token's heads back to back
    (the slices of a fused qkv row qualify), rows [T * H] of the caches as [-1, D], the
    largest `max_row` (the kernel copies without bounds checks)."""
    library = load_cpp_library()
    assert library is not None
    if rows.numel() != k.shape[0] * k.shape[1] or rows.dtype != torch.int64 \
            or not rows.is_contiguous():
        raise ValueError(f"{rows.numel()} cache rows for {k.shape[0]}x{k.shape[1]} heads")
    if max_row >= k_cache.numel() // k_cache.shape[-1]:
        raise IndexError(f"KV cache row {max_row} is outside a cache of "
                         f"{k_cache.numel() // k_cache.shape[-1]}")
    if k_cache.dtype == torch.int8:
        library.loom_write_kv_codes(k.data_ptr(), k.stride(0) * k.element_size(), v.data_ptr(),
                                    v.stride(0) * v.element_size(),
                                    int(k.dtype == torch.bfloat16), k_cache.data_ptr(),
                                    v_cache.data_ptr(), rows.data_ptr(), k.shape[0], k.shape[1],
                                    k.shape[2])
        return
    library.loom_write_kv(k.data_ptr(), k.stride(0) * k.element_size(), v.data_ptr(),
                          v.stride(0) * v.element_size(), k_cache.data_ptr(), v_cache.data_ptr(),
                          rows.data_ptr(), k.shape[0], k.shape[1],
                          k.shape[2] * k.element_size())


@functools.cache
def load_cpp_library() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernels; None, logged, when that fails."""
    return load_library("paged_decode", "the torch path", {
        "loom_write_kv": ([PTR, I64, PTR, I64, PTR, PTR, PTR, I64, I64, I64], None),
        "loom_write_kv_codes": ([PTR, I64, PTR, I64, INT, PTR, PTR, PTR, I64, I64, I64], None),
        "loom_paged_decode": ([INT, INT, PTR, I64, PTR, PTR, PTR, I64, PTR, PTR, I64, PTR, I64, I64,
                               I64, I64, I64, FLOAT, I64, FLOAT, INT, PTR, INT], ctypes.c_int),
        "loom_int8_key_products": ([], ctypes.c_int),
    })


QUERY_CODE_TOP = 16383  # int8_vnni.h's kQueryTop


def int8_key_products() -> bool:
    """Whether int8 keys under bf16 queries are multiplied as integers (AVX512-VNNI): each
    query head then scores as its values rounded to multiples of 1/16383 of its largest,
    after the softmax scale (`query_as_coded`)."""
    library = load_cpp_library()
    return library is not None and bool(library.loom_int8_key_products())


def query_as_coded(q: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 queries that score, through fp32 products, as `int8_key_products` scores `q`:
    each head's scaled values on its 15-bit grid, divided by the scale again."""
    scale_t = torch.tensor(scale, dtype=torch.float32)
    scaled = q.float() * scale_t
    top = scaled.abs().amax(-1, keepdim=True)
    # A true division, as the kernel's (a scalar over a tensor is a reciprocal times it).
    to_int = torch.where(top > 0, torch.full_like(top, QUERY_CODE_TOP) / top, 0.0)
    return torch.round(scaled * to_int) * (top / QUERY_CODE_TOP) / scale_t


@functools.cache
def load_cpp_decode() -> ctypes._CFuncPtr | None:
    """The paged-decode kernel, or None (logged) when the library cannot be built: to ask
    whether it serves. Calls go through `load_cpp_library()`'s attribute, which a kernel
    tape's recording stands in for (engine.executor.kernel_tape); this cached one it cannot."""
    library = load_cpp_library()
    return None if library is None else library.loom_paged_decode
