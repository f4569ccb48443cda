"""Data parallelism through launch.py: two engines (`--data-parallel-size 2`) on the tiny
model behind one frontend.

- 64 concurrent streams all complete, and both engines served some of them;
- a shared-prefix workload lands on the engine that holds each prefix: more prefix-cache hits
  under cache_aware routing than under round robin, on the same requests;
- kill -9 of one engine under load fails only its streams (error events), the others
  complete, new requests succeed at once, /health stays 200, and launch restarts the engine,
  which serves again;
- clients that hang up abort their requests on whichever engine serves them;
- no engine leaks a KV block (each one's usage back to 0, no integrity violation).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import pytest

from bench.launched import child_pids, command_line
from bench.soak import StreamOutcome, read_metrics, stream_one, wait_idle
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

ENGINES = ("0", "1")


def start(factory: pytest.TempPathFactory, *args: str) -> LaunchedServer:
    model = shared_tiny_model(factory)
    return tiny_server(model, "--data-parallel-size", "2", "--num-kv-blocks", "1024",
                       *args).start(factory.mktemp("logs"))


def engine_pid(server: LaunchedServer, rank: int) -> int:
    """The engine process launch.py started for data-parallel rank `rank`."""
    for pid in child_pids(server.process.pid):
        try:
            argv = command_line(pid).split()
        except OSError:
            continue
        if argv[1:3] == ["-m", "engine"] and f"--data-parallel-rank {rank}" in " ".join(argv):
            return pid
    raise LookupError(f"no engine of rank {rank}")


def listening_tcp_ports(pids: list[int]) -> set[int]:
    """TCP ports the processes `pids` listen on (any address)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def body(prompt: str, max_tokens: int) -> dict:
    return {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}


def per_engine(samples: dict[str, float], name: str) -> dict[str, float]:
    return {rank: samples.get(f'loom:{name}{{engine="{rank}"}}', 0.0) for rank in ENGINES}


def assert_no_leaks(samples: dict[str, float]) -> None:
    assert per_engine(samples, "engine_kv_cache_usage_perc") == {"0": 0.0, "1": 0.0}
    assert samples["loom:kv_integrity_violations_total"] == 0


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def test_two_engines_share_64_streams(tmp_path_factory: pytest.TempPathFactory) -> None:
    with start(tmp_path_factory) as server:
        # Engines on this host talk over ipc: nothing but the HTTP port listens on tcp.
        processes = [server.process.pid, *child_pids(server.process.pid)]
        assert listening_tcp_ports(processes) == {server.port}
        url = server.base_url + "/v1/completions"
        async with session() as http:
            outcomes = await asyncio.gather(*(
                stream_one(http, url, body(f"Request {i} asks about item {i * 7}", 16))
                for i in range(64)))
            samples = await wait_idle(http, server.base_url)
    assert [outcome.kind for outcome in outcomes] == ["completed"] * 64
    served = per_engine(samples, "engine_generation_tokens_total")
    assert sum(served.values()) == 64 * 16
    assert min(served.values()) >= 8 * 16, served  # the work is split, not all on one
    assert samples["loom:engines_live"] == 2
    assert_no_leaks(samples)


async def test_clients_hanging_up_abort_on_whichever_engine_serves_them(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with start(tmp_path_factory) as server:
        url = server.base_url + "/v1/completions"
        async with session() as http:
            cut = await asyncio.gather(*(
                stream_one(http, url, body(f"Hang up on request {i}", 1500), cut_after_chunks=2)
                for i in range(8)))
            samples = await wait_idle(http, server.base_url)
    assert all(outcome.cut for outcome in cut)
    served = per_engine(samples, "engine_generation_tokens_total")
    assert min(served.values()) > 0, served  # both engines had some
    assert sum(served.values()) < 8 * 1500 / 2  # aborted long before their 1500 tokens
    assert per_engine(samples, "engine_num_requests_running") == {"0": 0.0, "1": 0.0}
    assert samples['loom:request_success_total{finished_reason="abort"}'] == 8
    assert_no_leaks(samples)


async def prefix_hits(server: LaunchedServer) -> float:
    """8 groups of 4 requests, each group sharing a 6-block prompt prefix: each group's
    first request alone, then the other 24 at once."""
    url = server.base_url + "/v1/completions"
    groups = [" ".join(f"group {g} shares this long context, part {j}." for j in range(20))
              for g in range(8)]
    async with session() as http:
        firsts = await asyncio.gather(*(stream_one(http, url, body(f"{prefix} Q0", 4))
                                        for prefix in groups))
        rest = await asyncio.gather(*(stream_one(http, url, body(f"{prefix} Q{q}", 4))
                                      for prefix in groups for q in range(1, 4)))
        samples = await wait_idle(http, server.base_url)
    assert all(outcome.completed for outcome in firsts + rest)
    assert_no_leaks(samples)
    return samples["loom:prefix_cache_hits_total"]


async def test_requests_go_to_the_engine_holding_their_prefix(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with start(tmp_path_factory, "--routing-policy", "round_robin") as server:
        round_robin = await prefix_hits(server)
    with start(tmp_path_factory) as server:  # cache_aware, the default
        cache_aware = await prefix_hits(server)
    # Round robin sends each group's requests to both engines, so each prefix is computed
    # twice; cache-aware routing computes it once.
    assert cache_aware > round_robin > 0, (cache_aware, round_robin)


async def test_a_killed_engine_fails_only_its_streams_and_comes_back(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with start(tmp_path_factory) as server:
        url = server.base_url + "/v1/completions"
        async with session() as http:
            watched = [StreamOutcome() for _ in range(16)]
            streams = [asyncio.ensure_future(stream_one(
                http, url, body(f"Long request {i} about item {i}", 600), outcome=outcome))
                for i, outcome in enumerate(watched)]
            async with asyncio.timeout(60):  # every stream has tokens before the kill
                while not all(outcome.chunks for outcome in watched):
                    await asyncio.sleep(0.01)
            killed = engine_pid(server, 1)
            os.kill(killed, signal.SIGKILL)
            during = await stream_one(http, url, body("Right after the kill", 8))
            async with http.get(server.base_url + "/health") as health:
                health_during = health.status
            outcomes = await asyncio.gather(*streams)
            async with asyncio.timeout(60):
                while "engine 1 is back" not in server.log:
                    await asyncio.sleep(0.05)
                while (await read_metrics(http, server.base_url))["loom:engines_live"] < 2:
                    await asyncio.sleep(0.05)
            restarted = engine_pid(server, 1)
            before = per_engine(await read_metrics(http, server.base_url),
                                "engine_generation_tokens_total")
            after_restart = await asyncio.gather(*(
                stream_one(http, url, body(f"After the restart {i}", 8)) for i in range(8)))
            samples = await wait_idle(http, server.base_url)
    failed = [outcome for outcome in outcomes if outcome.error]
    completed = [outcome for outcome in outcomes if outcome.completed]
    assert failed and completed and len(failed) + len(completed) == 16, outcomes
    for outcome in failed:  # an error event, then a clean end of the stream
        assert outcome.status == 200 and outcome.chunks > 0 and outcome.done, outcome
        assert "engine" in outcome.error.lower()
    assert during.completed and health_during == 200
    assert "engine 1 was killed by signal SIGKILL" in server.log
    assert restarted != killed
    assert all(outcome.completed for outcome in after_restart)
    served = per_engine(samples, "engine_generation_tokens_total")
    assert served["1"] > before["1"], (before, served)  # the new engine 1 serves
    assert samples['loom:engine_restarts_total{engine="1"}'] == 1
    assert_no_leaks(samples)


def test_launch_gives_up_only_when_no_engine_can_be_kept_alive() -> None:
    """The restart policy, without processes: backoff doubles, and launch fails only when
    every engine is dead and has failed its restarts."""
    import argparse

    from launch import MAX_FAILED_RESTARTS, ChildFailed, EngineSlot, Launcher

    class Dead:
        returncode = -9

        def poll(self) -> int:
            return self.returncode

    launcher = Launcher.__new__(Launcher)
    launcher.args = argparse.Namespace()
    launcher.stopping = False
    launcher.engines = [EngineSlot(rank, None, f"engine {rank}", Dead())  # type: ignore[arg-type]
                        for rank in range(2)]
    launcher.engines[0].failed_restarts = MAX_FAILED_RESTARTS
    launcher._give_up_if_all_failed()  # engine 1 still has restarts left
    launcher.engines[1].failed_restarts = MAX_FAILED_RESTARTS
    with pytest.raises(ChildFailed, match="no engine could be kept alive"):
        launcher._give_up_if_all_failed()
    started = time.monotonic()
    launcher.engines[1].failed_restarts = 2
    launcher._keep_alive(launcher.engines[1])  # schedules, does not restart yet
    assert launcher.engines[1].restart_at == pytest.approx(started + 4.0, abs=0.5)
