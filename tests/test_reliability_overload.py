"""A bounded waiting queue: a burst past it gets 503 + Retry-After at once; the admitted
requests all complete."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from bench.soak import StreamOutcome, stream_one
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

MAX_WAITING = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "1024",
                           "--max-num-seqs", "2", "--max-waiting-requests", str(MAX_WAITING))
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log


def body(stream: bool, n: int = 1) -> dict:
    return {"model": TINY_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 24,
            "ignore_eos": True, "stream": stream, "n": n}


async def post_plain(session: aiohttp.ClientSession, url: str, n: int = 1):
    started = time.monotonic()
    async with session.post(url, json=body(False, n)) as response:
        return response.status, dict(response.headers), await response.json(), \
            time.monotonic() - started


async def test_a_burst_past_the_bound_gets_503_with_retry_after(server: LaunchedServer):
    url = server.base_url + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        # Streaming and plain requests interleaved, all at once.
        results = await asyncio.gather(*(
            stream_one(session, url, body(True)) if i % 2 else post_plain(session, url)
            for i in range(24)
        ))
        streamed: list[StreamOutcome] = results[1::2]
        plain = results[::2]

        refused = [r for r in plain if r[0] == 503]
        served = [r for r in plain if r[0] == 200]
        assert len(refused) + len(served) == len(plain), plain
        for _, headers, payload, elapsed in refused:
            assert int(headers["Retry-After"]) >= 1
            assert payload["error"]["type"] == "service_unavailable"
            assert payload["error"]["code"] == "server_overloaded"
            assert elapsed < 2.0  # refused at once, not after the admitted ones
        for _, _, payload, _ in served:
            assert payload["choices"][0]["finish_reason"] == "length"
            assert payload["usage"]["completion_tokens"] == 24
        assert all(s.completed or s.rejected for s in streamed), streamed
        for outcome in streamed:
            if outcome.rejected:
                assert "server_overloaded" in (outcome.error or "")
        admitted = len(served) + sum(s.completed for s in streamed)
        rejected = len(refused) + sum(s.rejected for s in streamed)
        assert admitted >= MAX_WAITING and rejected > 0

        metrics = await session.get(server.base_url + "/metrics")
        text = await metrics.text()
        assert f'loom:num_requests_rejected_total{{reason="overloaded"}} {rejected}.0' in text

        # The burst is over: the server takes requests again, n choices counted one by one.
        status, _, payload, _ = await post_plain(session, url, n=3)
        assert status == 200 and len(payload["choices"]) == 3
