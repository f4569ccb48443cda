"""Every C++ kernel source compiles for the CPUs Loom serves on, not only this machine's: the
build takes -march=native, so a path guarded for one instruction set (AVX-512, VNNI, AMX) that
leans on a name defined only under its guard breaks the others' builds unseen here (and their
attention falls back to torch). g++ checks each source's syntax for each target."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engine.kernels.build import CPP_FLAGS, SOURCE_DIR

TARGETS = {
    "x86-64": ["-march=x86-64"],
    "avx2": ["-march=haswell"],
    "avx512": ["-march=skylake-avx512"],
    "avx512-vnni-bf16": ["-march=cooperlake"],
    "amx": ["-march=sapphirerapids"],
}
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.stem)
def test_a_kernel_source_compiles_for_every_target(source: Path, target: str) -> None:
    flags = [flag for flag in CPP_FLAGS if flag not in ("-march=native", "-shared")]
    result = subprocess.run(["g++", *flags, *TARGETS[target], "-fsyntax-only",
                             f"-I{SOURCE_DIR}", str(source)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
