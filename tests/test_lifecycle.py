"""launch.py supervision: SIGTERM stops everything; a dead engine takes launch down, named."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from bench.launched import child_pids, children_by_role
from common.default_model import ensure_default_model
from tests.launched_server import LaunchedServer, process_exists

pytestmark = pytest.mark.e2e


def test_sigterm_stops_both_children_and_leaves_no_process(tmp_path):
    server = LaunchedServer().start(tmp_path)
    children = child_pids(server.process.pid)
    assert len(children) == 2
    assert server.health_status() == 200
    assert server.stop() == 0, server.log
    assert not any(process_exists(pid) for pid in children)


def test_killing_the_engine_makes_launch_exit_non_zero_naming_it(tmp_path):
    server = LaunchedServer().start(tmp_path)
    frontend = server.child("frontend")
    os.kill(server.child("engine"), signal.SIGKILL)
    returncode = server.process.wait(timeout=30)
    assert returncode != 0
    assert "engine was killed by signal SIGKILL" in server.log
    assert not process_exists(frontend)


def model_whose_weights_are_broken(tmp_path: Path) -> Path:
    """The default model's tokenizer and config beside a model.safetensors that is not one:
    the frontend (started beside the engine) loads fine, the engine fails before READY."""
    model = tmp_path / "broken-model"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        (model / name).symlink_to(Path(ensure_default_model()) / name)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    return model


def test_an_engine_failing_before_ready_takes_down_the_frontend_started_beside_it(tmp_path):
    server = LaunchedServer(launch_args=["--model", str(model_whose_weights_are_broken(tmp_path))])
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.start(tmp_path)
    assert "engine exited" in server.log or "engine closed its READY pipe" in server.log, (
        server.log)
    assert "no engine info: the engine did not become ready" in server.log, server.log
    assert "Traceback" not in server.log.split("[launch] error:")[-1]


def test_sigterm_during_start_up_stops_both_children(tmp_path):
    server = LaunchedServer()
    server.log_path = tmp_path / "launch.log"
    with open(server.log_path, "wb") as log:
        server.process = server.spawn(log)
    while "frontend" not in children_by_role(server.process.pid):  # spawned beside the engine
        assert server.process.poll() is None, server.log
    children = list(children_by_role(server.process.pid).values())
    server.send(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0, server.log
    assert not any(process_exists(pid) for pid in children)
