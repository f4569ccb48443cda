"""bench.burst on a tiny-model Loom: steady streams, with and without a burst of prompts
longer than the model's context (2048 tokens), which the frontend must refuse with 400."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.burst import main
from tests.tiny_server import build_tiny_served_model, tiny_server

CONCURRENCY, BURST_SIZE = 4, 3
ERROR_FIELDS = {"message", "type", "param", "code"}


def test_burst_refused_while_streams_keep_flowing(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = build_tiny_served_model(tmp_path / "model")
    server = tiny_server(model_dir, "--num-kv-blocks", "256")
    server.start(tmp_path)
    try:
        code = main(["--base-url", server.base_url, "--tokenizer", model_dir,
                     "--concurrency", str(CONCURRENCY), "--burst-size", str(BURST_SIZE),
                     "--output-len", "24", "--burst-delay", "0.3", "--duration", "1.5",
                     "--save-json", str(tmp_path / "burst.json")])
    finally:
        server.stop()
    assert code == 0
    steady, burst = json.loads((tmp_path / "burst.json").read_text())
    for run in (steady, burst):
        assert run["steady_failed"] == 0, run["steady_errors"]
        assert run["steady_completed"] >= CONCURRENCY
        assert run["itl_gaps"] > 0
        assert run["itl_ms"]["median"] is not None and run["itl_ms"]["p99"] is not None
        assert run["step_time"]["count"] > 0
        assert run["step_time"]["p50_ms"] is not None and run["step_time"]["p99_ms"] is not None
    assert not steady["burst_fired"] and steady["burst"] == []
    assert burst["burst_fired"] and len(burst["burst"]) == BURST_SIZE
    for outcome in burst["burst"]:
        assert outcome["status"] == 400, outcome
        assert set(outcome["error"]) == ERROR_FIELDS
        assert outcome["error"]["type"] == "invalid_request_error"
        assert outcome["error"]["code"] == "context_length_exceeded"
        assert outcome["latency_s"] > 0
    assert burst["burst_statuses"] == {"400": BURST_SIZE}
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| steady")]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| steady", f"{steady['steady_completed']} / 0"],
        [f"| steady + burst of {BURST_SIZE}", f"{burst['steady_completed']} / 0"],
    ]
