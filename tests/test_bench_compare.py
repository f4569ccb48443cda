"""bench.compare on the tiny model: two Loom modes started through launch.py, plus a --url."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.launched import REPO_ROOT
from common.sockets import free_port
from tests.tiny_server import build_answer_model


@pytest.fixture
def canned_url() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.canned_server", "--port", str(port)],
                               cwd=REPO_ROOT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_one_row_per_target(tmp_path: Path, canned_url: str) -> None:
    model_dir = build_answer_model(tmp_path)
    table, report = tmp_path / "table.md", tmp_path / "runs.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--model", model_dir,
         "--modes", "continuous,static", "--concurrency", "2", "--url", f"canned={canned_url}",
         "--num-prompts", "4", "--output-len", "8",
         "--launch-args", "--dtype float32 --num-kv-blocks 256",
         "--output", str(table), "--save-json", str(report), "--plot", str(tmp_path / "img"),
         "--log-dir", str(tmp_path / "logs"), "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    rows = [line for line in table.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| target")]
    assert [row.split(" | ")[:4] for row in rows] == [
        ["| loom continuous", "2", "1", "4 / 0"],
        ["| loom static", "2", "1", "4 / 0"],
        ["| canned", "2", "1", "4 / 0"],
    ]
    assert "Medians over" not in completed.stdout
    assert table.read_text() in completed.stdout
    runs = json.loads(report.read_text())
    assert [(run["target"], run["completed"]) for run in runs] == [
        ("loom continuous", 4), ("loom static", 4), ("canned", 4)]
    assert (tmp_path / "img" / "scaling.png").is_file()


def test_a_peer_server_is_started_fresh_for_every_cell_and_stopped(tmp_path: Path) -> None:
    table, logs = tmp_path / "table.md", tmp_path / "logs"
    peer = f"canned={sys.executable} -m tests.canned_server --port {{port}}"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--modes", "", "--concurrency", "1,2",
         "--peer", peer, "--num-prompts", "4", "--output-len", "8", "--output", str(table),
         "--log-dir", str(logs), "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    rows = [line.split(" | ")[:4] for line in table.read_text().splitlines()
            if line.startswith("| canned")]
    assert rows == [["| canned", "1", "1", "4 / 0"], ["| canned", "2", "1", "4 / 0"]]
    peer_logs = sorted(logs.glob("peer-*.log"))
    assert len(peer_logs) == 2, "one fresh peer per concurrency level"
    ports = [int(path.stem.removeprefix("peer-")) for path in peer_logs]
    for port in ports:  # every peer was stopped: its port is free again
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_peer_command_without_a_port_is_refused(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--modes", "", "--concurrency", "1",
         "--peer", f"x={sys.executable} -m tests.canned_server", "--num-prompts", "1",
         "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert "no {port}" in completed.stderr


def test_rounds_rotate_the_targets_order_and_report_medians(tmp_path: Path) -> None:
    table = tmp_path / "table.md"
    peers = [arg for name in ("a", "b") for arg in
             ("--peer", f"{name}={sys.executable} -m tests.canned_server --port {{port}}")]
    completed = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--modes", "", "--concurrency", "1", *peers,
         "--rounds", "3", "--num-prompts", "2", "--output-len", "4", "--output", str(table),
         "--log-dir", str(tmp_path / "logs"), "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    starts = [line.split()[2].rstrip(":") for line in completed.stderr.splitlines()
              if line.startswith("[compare] starting")]
    assert starts == ["a", "b", "b", "a", "a", "b"]
    text = table.read_text()
    runs = [line.split(" | ")[:3] for line in text.split("Medians over")[0].splitlines()
            if line.startswith(("| a ", "| b "))]
    assert runs == [["| a", "1", str(r)] for r in (1, 2, 3)] + [
        ["| b", "1", str(r)] for r in (1, 2, 3)]
    medians = [line.split(" | ") for line in text.split("Medians over 3 rounds")[1].splitlines()
               if line.startswith(("| a ", "| b "))]
    assert (medians[0][0], len(medians[0][2].split()), medians[0][4]) == ("| a", 3, "1.000")
    assert medians[1][0] == "| b" and len(medians[1][2].split()) == 3
    speeds = [float(value) for value in medians[1][2].split()]
    assert float(medians[1][3]) == pytest.approx(sorted(speeds)[1], abs=0.05)
    assert float(medians[1][5]) > float(medians[1][3])  # total tok/s counts the prompts too


def test_rounds_below_one_are_refused() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--modes", "", "--rounds", "0",
         "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert "--rounds" in completed.stderr
