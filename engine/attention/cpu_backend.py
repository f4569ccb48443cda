"""Paged attention on the CPU with our C++ kernel (engine/kernels/cpu/paged_decode.cpp).

The kernel reads the paged cache in place for every request with one new token ("decodes").
On bf16 caches where the CPU has AMX or AVX512-BF16, every prefill chunk takes the tiled
prefill kernel (engine/kernels/cpu/paged_prefill.cpp); elsewhere the decode kernel takes
every row of every chunk, each row a decode over its own causal prefix
(engine.attention.metadata.plan_step). In batch-invariant mode every row is a decode row.
The step's KV write is one C++ call.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchBackend
from engine.kernels.elementwise import rows_of_contiguous_heads
from engine.kernels.paged_decode import (
    CODE_KINDS,
    CPP_MAX_DIM,
    CPP_MAX_GROUP,
    load_cpp_decode,
    run_paged_decode,
    run_write_kv,
)
from engine.kernels.paged_prefill import run_paged_prefill


class CpuBackend(TorchBackend):
    name = "cpu-c++"
    uses_kernel = True

    def __init__(self, block_size: int, num_kv_heads: int, tiled_prefill: bool = False,
                 rows_only: bool = False) -> None:
        """`tiled_prefill`: long prefill chunks take the tiled kernel (the selector checks
        `tiled_prefill_supports` for the cache's dtype and shape); `rows_only`: every query
        row is a decode row of the C++ kernel (batch-invariant mode)."""
        super().__init__(block_size, num_kv_heads)
        self.tiled_prefill = tiled_prefill
        self.rows_only = rows_only

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, cache_dtype: torch.dtype | None = None) -> bool:
        """fp32 or bf16 on the CPU, caches of that dtype or 8-bit codes, query groups and head
        size the kernel's registers hold, and a kernel that builds here."""
        cache_dtype = cache_dtype or dtype
        return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and (cache_dtype == dtype or cache_dtype in CODE_KINDS)
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= CPP_MAX_GROUP
                and head_dim <= CPP_MAX_DIM and load_cpp_decode() is not None)

    def write_rows(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: torch.Tensor, max_row: int | None) -> None:
        """One C++ call for both caches, reading k and v in place (on a fused qkv row they
        are strided slices that `reshape` would copy)."""
        if not (k.dtype == v.dtype and k_cache.dtype == v_cache.dtype
                and k_cache.dtype in (k.dtype, torch.int8)):
            super().write_rows(k, v, k_cache, v_cache, rows, max_row)
            return
        if not rows_of_contiguous_heads(k):
            k = k.contiguous()
        if not rows_of_contiguous_heads(v):
            v = v.contiguous()
        if max_row is None:
            max_row = int(rows.max()) if rows.numel() else -1
        run_write_kv(k, v, k_cache, v_cache, rows, max_row)

    def attend_kernel_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                           window: int | None, softcap: float | None) -> None:
        plan = metadata.plan
        assert plan is not None
        if plan.kernel_rows is not None:
            run_paged_decode(q, k_cache, v_cache, plan.kernel_rows, scale, out, window, softcap)
        if plan.tiled_prefills is not None:
            run_paged_prefill(q, k_cache, v_cache, plan.tiled_prefills, scale, out,
                              metadata.workspace, window, softcap)
