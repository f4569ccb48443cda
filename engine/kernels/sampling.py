"""Sampling on the CPU in C++ (`kernels/cpu/sampling.cpp`), reading the output projection's
bf16 or fp32 logits as they are: greedy rows' first maxima in one pass, and random rows
(temperature, top_k, top_p, min_p) by inverse CDF from one uniform draw each. Built once by
`engine.kernels.build` and loaded through ctypes; None where it cannot be built."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from engine.kernels.build import I64, INT, PTR, load_library


@functools.cache
def load_sampling() -> ctypes.CDLL | None:
    return load_library("sampling", "torch's max", {
        "loom_argmax_rows": ([INT, PTR, I64, I64, I64, PTR, INT], None),
        "loom_sample_rows": ([INT, PTR, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, INT], None),
    })


def kernel_reads(logits: torch.Tensor) -> bool:
    """[rows, vocab] fp32 or bf16 on the CPU, unit stride within rows."""
    return (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.dim() == 2 and logits.stride(-1) == 1)


def argmax_rows(library: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum: int64 [rows], logits as `kernel_reads` takes them."""
    if not kernel_reads(logits):
        raise TypeError(f"argmax over {logits.dtype} rows of stride {logits.stride()}")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.loom_argmax_rows(int(logits.dtype == torch.bfloat16), logits.data_ptr(),
                             logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                             torch.get_num_threads())
    return out


@dataclass(frozen=True, slots=True)
class RowFilters:
    """Per row: temperature (<= 0: greedy), top_k (0: off), top_p (1: off), min_p (0: off) and
    a uniform draw in [0, 1)."""

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    uniforms: torch.Tensor  # float64 [rows]


def sample_rows(library: ctypes.CDLL, logits: torch.Tensor, rows: RowFilters) -> torch.Tensor:
    """Each row's token, drawn from softmax(logits / T) as its filters leave it by the inverse
    CDF at its uniform: int64 [rows], logits as `kernel_reads` takes them."""
    if not kernel_reads(logits):
        raise TypeError(f"sampling {logits.dtype} rows of stride {logits.stride()}")
    count = logits.shape[0]
    temperatures = torch.tensor(rows.temperatures, dtype=torch.float32)
    top_ks = torch.tensor(rows.top_ks, dtype=torch.int64)
    top_ps = torch.tensor(rows.top_ps, dtype=torch.float32)
    min_ps = torch.tensor(rows.min_ps, dtype=torch.float32)
    uniforms = rows.uniforms.to(torch.float64).contiguous()
    if not all(len(values) == count for values in (temperatures, top_ks, top_ps, min_ps,
                                                   uniforms)):
        raise ValueError(f"filters for {count} rows expected")
    out = torch.empty(count, dtype=torch.int64)
    library.loom_sample_rows(int(logits.dtype == torch.bfloat16), logits.data_ptr(), count,
                             logits.shape[1], logits.stride(0), temperatures.data_ptr(),
                             top_ks.data_ptr(), top_ps.data_ptr(), min_ps.data_ptr(),
                             uniforms.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out
