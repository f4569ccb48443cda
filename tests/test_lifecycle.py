"""launch.py supervision: SIGTERM stops everything; a dead engine takes launch down, named."""

from __future__ import annotations

import os
import signal

import pytest

from bench.launched import child_pids
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
