"""What this machine's CPU can do: its feature flags, native bf16, and the dtype `auto` picks."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 instructions, else float32."""
    explicit = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name in explicit:
        return explicit[name]
    if name != "auto":
        raise ValueError(f"unsupported dtype {name!r}; use auto, float32 or bfloat16")
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AVX512-BF16 or AMX: oneDNN multiplies bf16 natively (the one check of it)."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


@functools.cache
def native_bf16_matmul() -> bool:
    """`cpu_has_native_bf16` for this machine, read once."""
    return cpu_has_native_bf16()


# The flags that decide which kernels run here: what a benchmark names beside its figures.
KERNEL_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                          "amx_int8"})


def kernel_flags() -> str:
    """This CPU's KERNEL_FLAGS, space-separated ("unknown" where none can be read)."""
    return " ".join(sorted(cpu_flags() & KERNEL_FLAGS)) or "unknown"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (the first "flags" line); empty where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()
