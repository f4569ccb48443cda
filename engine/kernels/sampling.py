"""Greedy sampling on the CPU as one C++ pass (`kernels/cpu/sampling.cpp`): each row's first
maximum, read straight from the output projection's bf16 or fp32 logits. Built once by
`engine.kernels.build` and loaded through ctypes; None where it cannot be built."""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.build import I64, INT, PTR, load_library


@functools.cache
def load_sampling() -> ctypes.CDLL | None:
    return load_library("sampling", "torch's max", {
        "loom_argmax_rows": ([INT, PTR, I64, I64, I64, PTR, INT], None),
    })


def argmax_rows(library: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] fp32 or bf16 on the CPU, unit stride within rows -> int64 [rows]."""
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(-1) != 1:
        raise TypeError(f"argmax over {logits.dtype} rows of stride {logits.stride()}")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.loom_argmax_rows(int(logits.dtype == torch.bfloat16), logits.data_ptr(),
                             logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                             torch.get_num_threads())
    return out
