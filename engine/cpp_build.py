"""Builds a plain C++ source (no torch headers: seconds) into a shared library with the
system's g++, once: cached under $LOOM_CACHE/kernels keyed by source, compiler, flags, CPU
and torch version, and loaded through ctypes by the kernel modules."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from common.default_model import default_cache_dir

logger = logging.getLogger(__name__)

CPP_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
             "-std=c++17"]
CPP_COMPILE_TIMEOUT_S = 120

# Numeric helpers every kernel source starts with: fp32 <-> bf16 (as uint16_t) and an exp in
# plain arithmetic that the compiler vectorizes.
CPP_NUMERICS = r"""
#include <cmath>
#include <cstdint>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // round to nearest even; NaN stays NaN
  uint32_t bits = __builtin_bit_cast(uint32_t, x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = uint16_t((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = uint16_t(bits >> 16);
}

// exp(x), x clamped to [-87, 88]: the float range without denormals or infinities.
inline float fast_exp(float x) {
  x = x > -87.0f ? (x < 88.0f ? x : 88.0f) : -87.0f;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

}  // namespace
"""


# ctypes argument types of the kernels' C signatures, by their C names.
I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def load_library(name: str, source: str, fallback: str,
                 signatures: dict[str, tuple[list[Any], Any]]) -> ctypes.CDLL | None:
    """Build (once, cached on disk) and load, each function of `signatures` given its
    (argument types, return type); None, with one warning naming `fallback`, when the
    library cannot be built here."""
    try:
        library = ctypes.CDLL(str(compiled_library(name, source)))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("C++ %s kernels unavailable, using %s: %s", name, fallback, error)
        return None
    for function, (argtypes, restype) in signatures.items():
        getattr(library, function).argtypes = argtypes
        getattr(library, function).restype = restype
    return library


def kernel_supports(*tensors: torch.Tensor) -> bool:
    """Contiguous CPU tensors of one dtype, fp32 or bf16: what the kernels take. (A loop: a
    generator and `device.type` made this check 2 µs, ~0.3 ms of a batch-1 decode step.)"""
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return False
    for t in tensors:  # noqa: SIM110
        if not (t.is_cpu and t.dtype is dtype and t.is_contiguous()):
            return False
    return True


def compiled_library(name: str, source: str) -> Path:
    """The built library's path; raises OSError (or a subprocess error) when it cannot build."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler found")
    # -march=native code must never be loaded on another CPU: the CPU is part of the key.
    key = hashlib.sha256("\n".join(
        [source, compiler, *CPP_FLAGS, cpu_signature(), torch.__version__]).encode())
    cache_dir = Path(os.environ.get("LOOM_KERNEL_CACHE") or default_cache_dir() / "kernels")
    library = cache_dir / f"{name}_{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as build_dir:
        source_path = Path(build_dir) / f"{name}.cpp"
        source_path.write_text(source)
        built = Path(build_dir) / library.name
        result = subprocess.run([compiler, *CPP_FLAGS, "-o", str(built), str(source_path)],
                                capture_output=True, text=True, timeout=CPP_COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise OSError(f"compiling {name} failed: {result.stderr[-2000:]}")
        os.replace(built, library)  # atomic: concurrent builders never see half a file
    return library


def cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() + platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
