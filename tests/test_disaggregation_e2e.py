"""Prefill/decode disaggregation through launch.py (`--data-parallel-size 2 --kv-roles
prefill,decode`) on the tiny model, real HTTP:

- greedy completions (streamed and not, prompts of several lengths, all at once) equal a
  single engine's, token for token; the prefill engine generated one token per request, the
  decode engine found the prompts' whole blocks handed over, and the relay moved bytes;
- clients hanging up mid-stream, or while their prompt is prefilled and handed over, leave
  no request running and no KV block held on either engine;
- a decode engine killed mid-stream fails only its streams, requests go on whole on the
  prefill engine meanwhile, and disaggregation resumes once launch.py restarted it;
- a prefill engine killed while streams decode elsewhere and new prompts arrive loses no
  request (those it held run whole on the decode engine), and disaggregation resumes.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from bench.soak import StreamOutcome, read_metrics, stream_one, wait_idle
from tests.launched_server import LaunchedServer
from tests.test_data_parallel import engine_pid, per_engine
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

PROMPTS = [[(11 * i + 7 * n) % 300 + 10 for i in range(length)]
           for n, length in enumerate([5, 16, 40, 63, 100, 150])]


def start(factory: pytest.TempPathFactory, *args: str) -> LaunchedServer:
    return tiny_server(shared_tiny_model(factory), "--num-kv-blocks", "1024",
                       *args).start(factory.mktemp("logs"))


def disaggregated(factory: pytest.TempPathFactory) -> LaunchedServer:
    return start(factory, "--data-parallel-size", "2", "--kv-roles", "prefill,decode")


def body(prompt: list[int] | str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def texts(server: LaunchedServer) -> list[str]:
    async with aiohttp.ClientSession() as http:
        async def complete(prompt: list[int]) -> str:
            async with http.post(server.base_url + "/v1/completions",
                                 json=body(prompt, 24)) as response:
                assert response.status == 200, await response.text()
                return (await response.json())["choices"][0]["text"]
        return await asyncio.gather(*map(complete, PROMPTS))


async def streams_decoding(http: aiohttp.ClientSession, url: str,
                           max_tokens: int) -> list[asyncio.Future[StreamOutcome]]:
    """A stream for each prompt, returned once each is decoding (on the decode engine)."""
    watched = [StreamOutcome() for _ in PROMPTS]
    streams = [asyncio.ensure_future(stream_one(
        http, url, body(prompt, max_tokens, stream=True), outcome=outcome))
        for prompt, outcome in zip(PROMPTS, watched, strict=True)]
    async with asyncio.timeout(60):
        while not all(outcome.chunks >= 2 for outcome in watched):
            await asyncio.sleep(0.01)
    return streams


async def transfer_hits_once_both_serve(http: aiohttp.ClientSession, base_url: str) -> float:
    """Prompt tokens handed over so far, once the killed engine is back."""
    async with asyncio.timeout(60):
        while (await read_metrics(http, base_url))["loom:engines_live"] < 2:
            await asyncio.sleep(0.05)
    return (await read_metrics(http, base_url))["loom:prefix_cache_transfer_hits_total"]


def assert_no_leaks(samples: dict[str, float]) -> None:
    assert per_engine(samples, "engine_kv_cache_usage_perc") == {"0": 0.0, "1": 0.0}
    assert per_engine(samples, "engine_num_requests_running") == {"0": 0.0, "1": 0.0}
    assert samples["loom:kv_integrity_violations_total"] == 0


async def test_disaggregated_greedy_output_equals_one_engines(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with start(tmp_path_factory) as server:
        expected = await texts(server)
    with disaggregated(tmp_path_factory) as server:
        assert await texts(server) == expected
        async with aiohttp.ClientSession() as http:
            before = await wait_idle(http, server.base_url)
            # Again: the decode engine holds its blocks, so none is sent.
            streamed = await stream_one(http, server.base_url + "/v1/completions",
                                        body(PROMPTS[4], 24, stream=True))
            samples = await wait_idle(http, server.base_url)
    assert streamed.completed and streamed.chunks >= 2
    generated = per_engine(samples, "engine_generation_tokens_total")
    assert generated == {"0": len(PROMPTS) + 1, "1": (len(PROMPTS) + 1) * 23}
    whole_blocks = sum(len(prompt) // 16 * 16 for prompt in PROMPTS)
    assert before["loom:prefix_cache_transfer_hits_total"] == whole_blocks
    assert before["loom:kv_transfer_bytes_total"] > 0
    for name in ("prefix_cache_transfer_hits_total", "kv_transfer_bytes_total"):
        assert samples[f"loom:{name}"] == before[f"loom:{name}"], name
    hits = per_engine(samples, "engine_prefix_cache_hits_total")["1"]
    assert hits - per_engine(before, "engine_prefix_cache_hits_total")["1"] == 96  # 100 tokens
    assert_no_leaks(samples)


async def test_clients_hanging_up_mid_stream_or_mid_hand_over_free_both_engines(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    long_prompts = [prompt * 12 for prompt in PROMPTS[2:]]  # 480 to 1,800 tokens
    with disaggregated(tmp_path_factory) as server:
        url = server.base_url + "/v1/completions"
        async with aiohttp.ClientSession() as http:
            decoding = await asyncio.gather(*(
                stream_one(http, url, body(prompt, 1500, stream=True), cut_after_chunks=3)
                for prompt in PROMPTS))
            mid_stream = await wait_idle(http, server.base_url)
            prefilling = await asyncio.gather(*(  # gone as soon as the response starts
                stream_one(http, url, body(prompt, 64, stream=True), cut_after_chunks=0)
                for prompt in long_prompts))
            samples = await wait_idle(http, server.base_url)
    assert all(outcome.cut for outcome in decoding + prefilling)
    aborted = 'loom:request_success_total{finished_reason="abort"}'
    assert mid_stream[aborted] == len(PROMPTS)
    assert_no_leaks(mid_stream)
    decoded = (per_engine(samples, "engine_generation_tokens_total")["1"]
               - per_engine(mid_stream, "engine_generation_tokens_total")["1"])
    assert decoded < len(long_prompts) * 63  # cut before their decode legs
    assert samples[aborted] == len(PROMPTS) + len(long_prompts)
    assert_no_leaks(samples)


async def test_a_killed_decode_engine_fails_only_its_streams(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with disaggregated(tmp_path_factory) as server:
        url = server.base_url + "/v1/completions"
        async with aiohttp.ClientSession() as http:
            streams = await streams_decoding(http, url, 600)
            os.kill(engine_pid(server, 1), signal.SIGKILL)
            outcomes = await asyncio.gather(*streams)
            during = await stream_one(http, url, body(PROMPTS[2], 8, stream=True))
            before = await transfer_hits_once_both_serve(http, server.base_url)
            after = await asyncio.gather(*(stream_one(http, url, body(prompt, 8, stream=True))
                                           for prompt in PROMPTS[3:]))
            samples = await wait_idle(http, server.base_url)
    assert all(outcome.error and "engine" in outcome.error.lower() and outcome.done
               for outcome in outcomes), outcomes
    assert during.completed and all(outcome.completed for outcome in after)
    # The new engine 1 takes KV again (prompts it has not seen).
    assert samples["loom:prefix_cache_transfer_hits_total"] > before
    assert_no_leaks(samples)


async def test_a_killed_prefill_engine_loses_no_request(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with disaggregated(tmp_path_factory) as server:
        url = server.base_url + "/v1/completions"
        async with aiohttp.ClientSession() as http:
            streams = await streams_decoding(http, url, 300)
            # And these are sent as it dies: whichever leg they reach, none is lost.
            burst = [asyncio.ensure_future(stream_one(
                http, url, body(prompt[::-1] * 2, 40, stream=True))) for prompt in PROMPTS]
            os.kill(engine_pid(server, 0), signal.SIGKILL)
            outcomes = await asyncio.gather(*streams, *burst)
            before = await transfer_hits_once_both_serve(http, server.base_url)
            after = await stream_one(http, url, body(PROMPTS[5][::2] * 3, 8, stream=True))
            samples = await wait_idle(http, server.base_url)
    assert all(outcome.completed for outcome in outcomes), outcomes
    assert after.completed
    assert samples["loom:prefix_cache_transfer_hits_total"] > before  # split again
    assert_no_leaks(samples)
