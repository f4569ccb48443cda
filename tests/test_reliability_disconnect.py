"""Clients that hang up: their requests are ABORTed and every KV block comes back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from bench.soak import StreamOutcome, stream_one
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "4096")
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log


def chat(max_tokens: int, stream: bool = True) -> dict:
    return {"model": TINY_MODEL_NAME, "stream": stream, "max_tokens": max_tokens,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Tell me a story."}]}


async def idle_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    from bench.soak import wait_idle

    return await wait_idle(session, base_url)


async def test_half_of_twenty_streams_cut_off_leave_nothing_behind(server: LaunchedServer):
    url = server.base_url + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        outcomes: list[StreamOutcome] = await asyncio.gather(*(
            # Long streams hung up after a few chunks; short ones read to the end.
            stream_one(session, url, chat(1500), cut_after_chunks=3 + i) if i % 2
            else stream_one(session, url, chat(40))
            for i in range(20)
        ))
        cut = [o for o in outcomes if o.cut]
        completed = [o for o in outcomes if o.completed]
        assert len(cut) == 10 and len(completed) == 10, outcomes
        assert all(o.finish_reason == "length" for o in completed)
        metrics = await idle_metrics(session, server.base_url)
    assert metrics["loom:num_requests_running"] == 0
    assert metrics["loom:num_requests_waiting"] == 0
    assert metrics["loom:kv_cache_usage_perc"] == 0
    assert metrics["loom:kv_integrity_violations_total"] == 0
    assert metrics['loom:request_success_total{finished_reason="abort"}'] >= 10
    assert metrics['loom:request_success_total{finished_reason="length"}'] >= 10
    # Each cut stream would have run 1500 tokens: far fewer were made.
    assert metrics["loom:generation_tokens_total"] < 10 * 40 + 10 * 300


async def test_non_streaming_clients_that_give_up_are_aborted(server: LaunchedServer):
    url = server.base_url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession() as session:
        async def give_up() -> None:
            with pytest.raises(TimeoutError):
                async with session.post(url, json=chat(1500, stream=False), timeout=timeout):
                    pass

        await asyncio.gather(*(give_up() for _ in range(4)))
        metrics = await idle_metrics(session, server.base_url)
    assert metrics["loom:num_requests_running"] == 0
    assert metrics["loom:kv_cache_usage_perc"] == 0
    assert metrics["loom:kv_integrity_violations_total"] == 0
