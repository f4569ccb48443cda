"""Each op's implementation and the attention backend are chosen once, when the model runner
starts, bound into the model's layers and logged in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.executor.model_runner import ModelRunner
from engine.layers.attention import PagedAttention
from engine.layers.custom_op import CustomOp
from engine.quantization.base import QuantizedLinear
from engine.weights.loader import load_model
from tests.engine_helpers import make_core
from tests.model_fixtures import build_tiny_llama_dir

CPU = torch.device("cpu")


def runner_for(model_dir: str, quantization: str = "none", compiled: bool = False,
               ) -> ModelRunner:
    model = load_model(model_dir, torch.float32, CPU, quantization=quantization)
    return ModelRunner(model, 16, 4, CPU, torch.float32, compiled=compiled)


def bound(module: torch.nn.Module, name: str) -> str | None:
    """The name of the method bound as the module's forward, None when it is the class's."""
    forward = module.__dict__.get("forward")
    return None if forward is None else getattr(forward, "__name__", name)


def test_eager_on_the_cpu_runs_our_kernels_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="loom.engine"):
        runner = make_core(build_tiny_llama_dir(tmp_path)).runner
    lines = [record.getMessage() for record in caplog.records
             if record.getMessage().startswith("kernels:")]
    assert lines == ["kernels: attention cpu-c++, elementwise C++, forward eager"]
    ops = [module for module in runner.model.modules() if isinstance(module, CustomOp)]
    assert len(ops) == 2 * 4 + 1  # per layer two norms, a rotary, an activation; final norm
    assert {bound(op, "") for op in ops} == {"forward_cpu"}
    assert all(bound(module, "") is None for module in runner.model.modules()
               if isinstance(module, PagedAttention))


def test_elementwise_kernels_can_be_ruled_out(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_CPP_ELEMENTWISE", "0")
    monkeypatch.setenv("LOOM_CPP_DECODE", "0")
    runner = runner_for(build_tiny_llama_dir(tmp_path))
    assert runner.kernels.describe() == ("kernels: attention torch, elementwise torch ops, "
                                         "forward eager")
    assert {bound(op, "") for op in runner.model.modules() if isinstance(op, CustomOp)} == {
        "forward_native"}


def test_compiled_runs_torch_ops_and_keeps_linears_and_attention_opaque(tmp_path: Path) -> None:
    runner = runner_for(build_tiny_llama_dir(tmp_path), quantization="int8", compiled=True)
    assert runner.kernels.describe().endswith("elementwise torch ops, forward compiled (inductor)")
    modules = list(runner.model.modules())
    assert {bound(op, "") for op in modules if isinstance(op, CustomOp)} == {"forward_native"}
    quantized = [module for module in modules if isinstance(module, QuantizedLinear)]
    assert quantized and all(bound(module, "") == "forward" for module in quantized)
    dense_copies = [module.dense for module in quantized]  # run inside their layer's op
    assert all(bound(module, "") is None for module in dense_copies)
    assert {bound(module, "") for module in modules
            if isinstance(module, PagedAttention)} == {"forward_as_op"}
