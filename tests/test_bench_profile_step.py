"""bench.profile_step on the tiny model: a row per step kind whose op classes add up to its wall
time, the model's GEMMs and attention among them."""

from __future__ import annotations

import inspect
import subprocess
import sys

import torch
from torch import nn

from bench import profile_step
from bench.launched import REPO_ROOT
from bench.profile_step import CLASSES
from engine.quantization.base import QuantizedLinear
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


class FakeClock:
    """perf_counter reading 0, 1, 2, ... seconds, one tick a call."""

    def __init__(self) -> None:
        self.ticks = iter(range(10**6))

    def __call__(self) -> float:
        return float(next(self.ticks))


def test_timed_calls_count_each_linear_once_from_its_outermost_entry(monkeypatch) -> None:
    """A quantized linear's 3-D input recurses through forward, and its dense copy (a packed
    or plain linear) is a timed call of the same class: the class gets the outermost call's
    time only. The wrappers are gone afterwards."""
    class DenseThrough(QuantizedLinear):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.in_features = self.out_features = 4
            self.bias = None
            self.kernel_rows = 0
            object.__setattr__(self, "_dense_call", nn.Linear(4, 4, bias=False))

    layer = DenseThrough()
    forward = QuantizedLinear.forward
    monkeypatch.setattr(profile_step.time, "perf_counter", FakeClock())
    timed = dict.fromkeys(profile_step.CLASSES, 0.0)
    with profile_step.timed_calls(timed):
        layer(torch.ones(2, 3, 4))
    # the outer forward starts at 0, the inner at 1, nn.Linear at 2; the inner calls end
    # unread, the outer at 3 (counting each call would give 1 + 3 + 5 seconds)
    assert timed["GEMM"] == 3e6
    assert sum(timed.values()) == 3e6
    assert QuantizedLinear.forward is forward and nn.Linear.forward is not None
    assert "wrapper" not in nn.Linear.forward.__qualname__


class FakeEvent:
    def __init__(self, name: str, parent: FakeEvent | None = None) -> None:
        self.name, self.cpu_parent = name, parent


def test_profiled_ops_inside_timed_calls_are_left_out() -> None:
    """The profiler's ops under a timed linear's frame are not counted again (nor scaled)."""
    path = inspect.getsourcefile(QuantizedLinear.forward)
    first = inspect.getsourcelines(QuantizedLinear.forward)[1]
    inside = FakeEvent("aten::addmm", FakeEvent(f"{path}({first + 3}): forward",
                                                FakeEvent("engine/core.py(300): step")))
    outside = FakeEvent("aten::addmm", FakeEvent("engine/core.py(300): step"))
    assert profile_step.in_timed_call(inside)
    assert not profile_step.in_timed_call(outside)
