"""The CI-sized soak: 20 seconds of streaming clients, a fifth of them hanging up, against
a tiny-model launch.py server; nothing may be lost and no KV block may leak.

Sized for a small shared machine (16 clients, answers up to 64 tokens); the full run is
`python -m bench.soak` (200 clients, 120 s).
"""

from __future__ import annotations

import json

import pytest

from bench.launched import children_by_role
from bench.soak import SoakConfig, print_report, run_soak
from tests.tiny_server import shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e


async def test_twenty_second_soak_loses_nothing_and_leaks_nothing(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    server = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "2048")
    server.start(tmp_path_factory.mktemp("logs"))
    try:
        config = SoakConfig(server.base_url, clients=16, duration_s=20.0, max_tokens=64,
                            max_prompt_words=200)
        report = await run_soak(config, children_by_role(server.process.pid))
    finally:
        assert server.stop() == 0, server.log
    print_report(report)
    print(json.dumps(report))
    assert report["requests"]["lost"] == 0, report["lost_examples"]
    assert not report["leaked"], report["leaks"]
    assert report["requests"]["completed"] > 0 and report["requests"]["cut"] > 0
    assert set(report["rss"]) == {"engine", "frontend"}
    assert all(rss["growth_mb"] is not None for rss in report["rss"].values())
