"""The prefix cache's disk tier served through launch.py, by engines sharing one directory.

- Two engines (`--data-parallel-size 2`, round robin) on one `--kv-offload-dir`: the second
  answers a prompt the first saw from the first's files, equal to the cold answer; both
  writing the same blocks at once leave whole files only.
- An engine killed while it writes a long prompt's blocks leaves nothing that loads: the
  server started again on the directory finds no debris, every file whole, and answers a
  prompt from disk as it answered it cold.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from bench.soak import read_metrics, wait_idle
from engine.kv_offload.disk_store import SUFFIX, TEMPORARY, _payload
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

FILES_TIMEOUT_S = 60.0


def offload_flags(directory: Path) -> list[str]:
    return ["--kv-offload-dir", str(directory), "--kv-offload-bytes", str(4 * 1024**3)]


def files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(whole entries, temporary files) under the tier's directory, any model key."""
    entries = [p for p in directory.rglob("*") if p.is_file()]
    return ([p for p in entries if p.name.endswith(SUFFIX)],
            [p for p in entries if p.name.startswith(TEMPORARY)])


def wait_for_entries(directory: Path, count: int) -> None:
    """Until at least `count` entries are written and no write is in flight."""
    deadline = time.monotonic() + FILES_TIMEOUT_S
    while True:
        written, in_flight = files(directory)
        if len(written) >= count and not in_flight:
            return
        assert time.monotonic() < deadline, (len(written), len(in_flight))
        time.sleep(0.01)


def assert_every_entry_whole(directory: Path) -> None:
    written, in_flight = files(directory)
    assert in_flight == []
    assert written and all(_payload(path.read_bytes()) is not None for path in written)


async def post_completion(session: aiohttp.ClientSession, base_url: str, model: str,
                          prompt: list[int], max_tokens: int = 6) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        return response.status, await response.json()


async def complete(session: aiohttp.ClientSession, base_url: str, model: str,
                   prompt: list[int], max_tokens: int = 6) -> dict:
    status, reply = await post_completion(session, base_url, model, prompt, max_tokens)
    assert status == 200, reply
    return reply


def disk_hits(samples: dict[str, float]) -> float:
    """Prompt tokens the disk tier supplied, all engines together."""
    return samples.get("loom:prefix_cache_disk_hits_total", 0.0)


def prompt_of(length: int, salt: int) -> list[int]:
    return [(7 * i + 31 * salt) % 40000 + 100 for i in range(length)]


async def test_two_engines_share_one_directory(tmp_path_factory: pytest.TempPathFactory,
                                               ) -> None:
    directory = tmp_path_factory.mktemp("kv")
    server = tiny_server(shared_tiny_model(tmp_path_factory), "--data-parallel-size", "2",
                         "--routing-policy", "round_robin", *offload_flags(directory))
    with server.start(tmp_path_factory.mktemp("logs")):
        async with aiohttp.ClientSession() as session:
            url = server.base_url
            seen, shared = prompt_of(320, 1), prompt_of(320, 2)
            cold = await complete(session, url, TINY_MODEL_NAME, seen)  # engine 0
            wait_for_entries(directory, 320 // 16 - 1)
            again = await complete(session, url, TINY_MODEL_NAME, seen)  # engine 1
            assert again["choices"][0]["text"] == cold["choices"][0]["text"]
            samples = await wait_idle(session, url)  # engine 0 hit its pool, engine 1 disk
            assert disk_hits(samples) >= 16 * (320 // 16 - 1)
            # Both engines prefill the same prompt at once and write the same blocks.
            both = await asyncio.gather(*(complete(session, url, TINY_MODEL_NAME, shared)
                                          for _ in range(2)))
            assert both[0]["choices"][0]["text"] == both[1]["choices"][0]["text"]
            wait_for_entries(directory, 2 * (320 // 16 - 1))
            assert_every_entry_whole(directory)
            await wait_idle(session, url)


async def test_an_engine_killed_mid_write_leaves_nothing_that_loads(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    directory = tmp_path_factory.mktemp("kv")
    logs = tmp_path_factory.mktemp("logs")
    flags = ["--dtype", "float32", *offload_flags(directory)]
    first = LaunchedServer(flags).start(logs)
    seen, cut = prompt_of(480, 3), prompt_of(1000, 4)
    try:
        async with aiohttp.ClientSession() as session:
            model = (await (await session.get(f"{first.base_url}/v1/models")).json())
            model_name = model["data"][0]["id"]
            cold = await complete(session, first.base_url, model_name, seen)
            wait_for_entries(directory, 480 // 16 - 1)
            before = len(files(directory)[0])
            (key_directory,) = [path for path in directory.iterdir() if path.is_dir()]
            engine = first.child("engine")
            writing = asyncio.ensure_future(
                post_completion(session, first.base_url, model_name, cut, max_tokens=1))
            while not any(name.startswith(TEMPORARY) for name in os.listdir(key_directory)):
                assert not writing.done()
                await asyncio.sleep(0)  # until a block of the long prompt is being written
            os.kill(engine, signal.SIGKILL)
            status, reply = await writing
            assert status != 200 and "error" in reply, reply  # the engine is gone
        assert first.process.wait(timeout=30) != 0
        assert len(files(directory)[0]) < before + 1000 // 16 - 1  # cut short
    finally:
        first.stop()
    second = LaunchedServer(flags).start(logs)
    with second:
        assert_every_entry_whole(directory)  # no debris: the scan at start removed it
        async with aiohttp.ClientSession() as session:
            again = await complete(session, second.base_url, model_name, seen)
            assert again["choices"][0]["text"] == cold["choices"][0]["text"]
            await complete(session, second.base_url, model_name, cut, max_tokens=1)
            samples = await read_metrics(session, second.base_url)
            assert disk_hits(samples) >= 16 * (480 // 16 - 1)
