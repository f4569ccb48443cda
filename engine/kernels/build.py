"""Builds a kernel's plain C++ source (`engine/kernels/cpu/<name>.cpp`, no torch headers:
seconds) into a shared library with the system's g++, once: cached under $LOOM_CACHE/kernels
keyed by the sources (the .cpp and every header beside it), compiler, flags, CPU and torch
version, and loaded through ctypes by the kernel modules."""

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

# -fno-thread-jumps: jump threading copies a clamp's constant branches into the vectorized
# loops, whose blended lanes then fill with denormals (a microcode assist each); see numerics.h.
CPP_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-thread-jumps", "-fopenmp",
             "-shared", "-fPIC", "-std=c++17"]
CPP_COMPILE_TIMEOUT_S = 120
SOURCE_DIR = Path(__file__).parent / "cpu"

# ctypes argument types of the kernels' C signatures, by their C names.
I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


# Every library loaded, with its functions' names: a recording (engine.executor.kernel_tape)
# stands in for them while a forward records.
_LOADED: list[tuple[ctypes.CDLL, tuple[str, ...]]] = []


def loaded_kernels() -> list[tuple[ctypes.CDLL, tuple[str, ...]]]:
    return list(_LOADED)


def kernel_enabled(variable: str) -> bool:
    """A kernel's switch: on unless the environment sets `variable` to 0."""
    return os.environ.get(variable, "1") != "0"


def load_library(name: str, fallback: str,
                 signatures: dict[str, tuple[list[Any], Any]]) -> ctypes.CDLL | None:
    """Build `<name>.cpp` (once, cached on disk) and load it, each function of `signatures`
    given its (argument types, return type); None, with one warning naming `fallback`, when
    the library cannot be built here."""
    try:
        library = ctypes.CDLL(str(compiled_library(name)))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("C++ %s kernels unavailable, using %s: %s", name, fallback, error)
        return None
    for function, (argtypes, restype) in signatures.items():
        getattr(library, function).argtypes = argtypes
        getattr(library, function).restype = restype
    _LOADED.append((library, tuple(signatures)))
    return library


def compiled_library(name: str) -> Path:
    """The built library's path; raises OSError (or a subprocess error) when it cannot build."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler found")
    source = SOURCE_DIR / f"{name}.cpp"
    sources = [source, *sorted(SOURCE_DIR.glob("*.h"))]
    # -march=native code must never be loaded on another CPU: the CPU is part of the key.
    key = hashlib.sha256("\n".join(
        [*(path.read_text() for path in sources), compiler, *CPP_FLAGS, cpu_signature(),
         torch.__version__]).encode())
    cache_dir = Path(os.environ.get("LOOM_KERNEL_CACHE") or default_cache_dir() / "kernels")
    library = cache_dir / f"{name}_{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as build_dir:
        built = Path(build_dir) / library.name
        result = subprocess.run(
            [compiler, *CPP_FLAGS, f"-I{SOURCE_DIR}", "-o", str(built), str(source)],
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
