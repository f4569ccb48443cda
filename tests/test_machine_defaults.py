"""What the engine takes from the machine when nothing is set (engine.platform.machine)."""

from __future__ import annotations

import logging

import pytest
import torch

from common.config import EngineConfig
from engine.core import EngineCore
from engine.platform.machine import GIB, Machine, available_memory
from tests.model_fixtures import build_tiny_llama_dir

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def machine(cores: int = 2, host_cores: int | None = None, memory_gib: float = 24,
            native_bf16: bool = True) -> Machine:
    return Machine(cores, host_cores or cores, int(memory_gib * GIB), native_bf16)


@pytest.mark.parametrize(("cores", "native_bf16", "budget"), [
    (1, True, 512), (2, True, 1024), (2, False, 512), (4, False, 1024), (16, True, 8192),
    (64, True, 8192)])
def test_the_token_budget_grows_with_cores_and_native_bf16(cores: int, native_bf16: bool,
                                                            budget: int) -> None:
    assert machine(cores, native_bf16=native_bf16).token_budget(CPU) == budget
    assert machine(cores, native_bf16=native_bf16).token_budget(CUDA) == 8192


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (7, 7), (8, 7), (32, 31)])
def test_threads_leave_a_core_to_the_frontend_on_larger_machines(cores: int,
                                                                 threads: int) -> None:
    assert machine(cores).threads == threads


def test_the_kv_cache_is_a_quarter_of_memory_split_by_core_share_and_bounded() -> None:
    assert machine(memory_gib=24).kv_cache_bytes == 6 * GIB
    assert machine(cores=1, host_cores=2, memory_gib=24).kv_cache_bytes == 3 * GIB  # DP slice
    assert machine(memory_gib=2).kv_cache_bytes == 1 * GIB
    assert machine(memory_gib=1024).kv_cache_bytes == 64 * GIB


def test_available_memory_is_read_from_this_host() -> None:
    assert available_memory() > 0
    detected = Machine.detect()
    assert detected.cores >= 1 and detected.host_cores >= detected.cores


def test_an_engine_takes_the_machine_defaults_and_logs_them(
        tiny_model_dir: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: machine(cores=1)))
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="loom.engine"):
        core = EngineCore(EngineConfig(model=tiny_model_dir, max_num_batched_tokens=None,
                                       max_num_seqs=4))
    try:
        assert core.config.max_num_batched_tokens == 512
        assert torch.get_num_threads() == 1
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("machine"))
        assert "1 compute threads (machine), 512 tokens per step (machine)" in line
        # At most every seat's whole context: 4 seats here, far below a quarter of 24 GiB.
        seat_blocks = -(-core.max_model_len // core.config.block_size)
        assert core.block_manager.num_blocks == 4 * seat_blocks
    finally:
        core.shutdown()
        torch.set_num_threads(threads)


def test_what_the_operator_sets_wins(tiny_model_dir: str, caplog: pytest.LogCaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: machine(cores=1)))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="loom.engine"):
        core = EngineCore(EngineConfig(model=tiny_model_dir, max_num_batched_tokens=96,
                                       num_kv_blocks=40))
    try:
        assert core.config.max_num_batched_tokens == 96 and core.block_manager.num_blocks == 40
        assert torch.get_num_threads() == 2
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("machine"))
        assert "2 compute threads (set), 96 tokens per step (set), KV cache size (set)" in line
    finally:
        core.shutdown()
        torch.set_num_threads(threads)
