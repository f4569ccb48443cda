"""`--scheduling-policy priority` over HTTP: among waiting requests, the lowest `priority`
value is admitted first, whatever the arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from bench.soak import StreamOutcome, read_metrics, stream_one
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "1024",
                           "--max-num-seqs", "1", "--scheduling-policy", "priority")
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log


def body(max_tokens: int, priority: int, stream: bool = False) -> dict:
    return {"model": TINY_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "priority": priority, "stream": stream}


async def wait_for_metric(session: aiohttp.ClientSession, server: LaunchedServer, name: str,
                          value: float) -> None:
    async with asyncio.timeout(30):
        while (await read_metrics(session, server.base_url)).get(name) != value:
            await asyncio.sleep(0.01)


async def test_the_lowest_priority_value_is_admitted_first(server: LaunchedServer) -> None:
    url = server.base_url + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        # One seat: a long request holds it while two others queue behind it.
        blocker = StreamOutcome()
        holding = asyncio.ensure_future(stream_one(session, url, body(2000, 0, stream=True),
                                                   outcome=blocker))
        async with asyncio.timeout(30):
            while not blocker.chunks:
                await asyncio.sleep(0.01)

        async def post(priority: int) -> int:
            async with session.post(url, json=body(16, priority)) as response:
                assert response.status == 200, await response.text()
                return priority

        late = asyncio.ensure_future(post(10))  # arrives first
        await wait_for_metric(session, server, "loom:num_requests_waiting", 1)
        urgent = asyncio.ensure_future(post(-10))
        await wait_for_metric(session, server, "loom:num_requests_waiting", 2)
        holding.cancel()  # the client leaves: its seat frees on the next step
        order = [await task for task in asyncio.as_completed([late, urgent])]
        assert order == [-10, 10]
        await wait_for_metric(session, server, "loom:num_requests_running", 0)
