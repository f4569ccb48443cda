"""bench.profile_step on the tiny model: a row per step kind whose op classes add up to its wall
time, the model's GEMMs and attention among them."""

from __future__ import annotations

import subprocess
import sys

from bench.launched import REPO_ROOT
from bench.profile_step import CLASSES
from tests.model_fixtures import build_tiny_llama_dir


def run_profile(tmp_path, batch: str, modes: str) -> subprocess.CompletedProcess:
    model_dir = build_tiny_llama_dir(tmp_path)
    completed = subprocess.run(
        [sys.executable, "-m", "bench.profile_step", "--model", model_dir, "--dtype", "float32",
         "--batch", batch, "--context", "8", "--prefill", "24", "--steps", "3",
         "--modes", modes],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    return completed


def test_profile_rows_split_each_step_by_op_class(tmp_path) -> None:
    completed = run_profile(tmp_path, "1,4", "eager")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in completed.stdout.splitlines()
            if line.startswith("| eager")}
    assert list(rows) == ["eager decode, batch 1", "eager decode, batch 4",
                          "eager prefill, 24 tokens"]
    for row in rows.values():
        cells = [cell.strip() for cell in row.strip("| ").split(" | ")]
        wall_ms = float(cells[1])
        class_ms = {name: float(cell.split()[0]) for name, cell in zip(CLASSES, cells[2:],
                                                                      strict=True)}
        share = {name: int(cell.split()[1].strip("(%)")) for name, cell in zip(
            CLASSES, cells[2:], strict=True)}
        assert wall_ms > 0
        assert abs(sum(class_ms.values()) - wall_ms) <= 0.02 * wall_ms + 0.2, row
        assert abs(sum(share.values()) - 100) <= len(CLASSES), row  # rounding
        assert share["GEMM"] > 0 and share["attention"] > 0, row
    assert "flags:" in completed.stdout


def test_taped_rows_class_each_replayed_call(tmp_path) -> None:
    """A taped decode step's kernels run inside the tape, not under our modules' frames: the
    timed replay still puts their time in its classes."""
    completed = run_profile(tmp_path, "1", "taped")
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| taped")]
    assert len(rows) == 1 and rows[0].startswith("| taped decode, batch 1 |")  # no prefill row
    cells = [cell.strip() for cell in rows[0].strip("| ").split(" | ")]
    class_ms = {name: float(cell.split()[0]) for name, cell in zip(CLASSES, cells[2:],
                                                                  strict=True)}
    assert abs(sum(class_ms.values()) - float(cells[1])) <= 0.02 * float(cells[1]) + 0.2
    share = {name: int(cell.split()[1].strip("(%)")) for name, cell in zip(CLASSES, cells[2:],
                                                                          strict=True)}
    # only inside the tape (the output norm and projection run outside it)
    assert sum(share[name] for name in ("attention", "KV write", "rope", "activation")) > 0
