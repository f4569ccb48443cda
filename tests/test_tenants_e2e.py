"""Tenants and deadlines against real processes: launch.py on the tiny random model with a
tenants file, real HTTP on 127.0.0.1. Two tenants' keys are served, an unknown key is a 401,
a tenant past its concurrency cap gets a 429 with Retry-After, a request whose deadline
passes while it waits is a 504, one whose deadline passes while it generates ends with its
partial output, and no KV block stays taken."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from frontend.tenants import key_digest
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model, tiny_server

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "sk-e2e-a", "sk-e2e-b"
TENANTS = f"""
[tenants.alpha]
key_sha256 = "{key_digest(KEY_A)}"
weight = 2
max_concurrent_requests = 1

[tenants.beta]
key_sha256 = "{key_digest(KEY_B)}"
"""
# tokens: ~2 s of decoding for the tiny model alone (~1 ms a token), longer than the
# deadlines that stop it
LONG = 2000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    launched = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512",
                           "--max-num-seqs", "1", "--tenants", str(path))
    launched.start(tmp_path_factory.mktemp("logs"))
    yield launched
    assert launched.stop() == 0, launched.log
    assert "Traceback" not in launched.log


def send(server: LaunchedServer, body: dict[str, Any], key: str | None,
         **headers: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        sent = {"Content-Type": "application/json", **headers}
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        connection.request("POST", "/v1/completions", body=json.dumps(body), headers=sent)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def completion(max_tokens: int) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "prompt": "Hello there", "max_tokens": max_tokens,
            "ignore_eos": True}


def metric(server: LaunchedServer, name: str) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_both_tenants_are_served_and_an_unknown_key_is_a_401(server):
    for key in (KEY_A, KEY_B):
        status, _, body = send(server, completion(2), key)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 2
    status, _, body = send(server, completion(2), "sk-nobody")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert metric(server, 'loom:tenant_requests_total{tenant="beta"}') >= 1


def test_deadlines_and_the_concurrency_cap(server):
    # alpha's long request holds the one seat (and alpha's one concurrent request) ...
    long_result: dict[str, Any] = {}

    def run_long() -> None:
        long_result["status"], _, long_result["body"] = send(
            server, completion(LONG), KEY_A, **{"X-Request-Timeout": "1"})

    runner = threading.Thread(target=run_long)
    runner.start()
    wait_until(lambda: metric(server, "loom:num_requests_running") == 1)
    # ... so another of alpha's is a 429 at once,
    status, headers, body = send(server, completion(2), KEY_A)
    assert status == 429 and int(headers["Retry-After"]) >= 1, body
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["param"] == "max_concurrent_requests"
    # and beta's request, waiting behind it, is dropped unstarted when its deadline passes.
    status, _, body = send(server, completion(2), KEY_B, **{"X-Request-Timeout": "0.3"})
    assert status == 504 and body["error"]["code"] == "deadline_exceeded", body
    assert "never started" in body["error"]["message"]
    # alpha's request is stopped at its own deadline with what it generated.
    runner.join(timeout=60)
    assert long_result["status"] == 200, long_result
    choice = long_result["body"]["choices"][0]
    assert choice["finish_reason"] == "length" and choice["native_finish_reason"] == "timeout"
    assert 0 < long_result["body"]["usage"]["completion_tokens"] < LONG
    # Idle again: every KV block is back and the engine's integrity check found nothing.
    wait_until(lambda: metric(server, "loom:num_requests_running") == 0
               and metric(server, "loom:num_requests_waiting") == 0)
    wait_until(lambda: metric(server, "loom:kv_cache_usage_perc") == 0)
    assert metric(server, "loom:kv_integrity_violations_total") == 0
    status, _, body = send(server, completion(2), KEY_A)
    assert status == 200, body


FLOOD_TENANTS = f"""
[tenants.alpha]
key_sha256 = "{key_digest(KEY_A)}"

[tenants.beta]
key_sha256 = "{key_digest(KEY_B)}"
"""


def test_a_tenant_flooding_the_queue_does_not_shut_the_other_out(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The waiting queue is full of alpha's requests, so alpha's next is a 503; beta, within
    its share of the open requests, is still taken, and its request starts at once in a seat
    alpha gives up (two seats, one each by weight)."""
    path = tmp_path_factory.mktemp("flood") / "tenants.toml"
    path.write_text(FLOOD_TENANTS)
    server = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512",
                         "--max-num-seqs", "2", "--max-waiting-requests", "2",
                         "--tenants", str(path))
    with server.start(tmp_path_factory.mktemp("logs")):
        results: list[int] = []
        flood: list[threading.Thread] = []

        def in_engine() -> float:
            return (metric(server, "loom:num_requests_running")
                    + metric(server, "loom:num_requests_waiting"))

        while not results:  # one at a time, each seen by the engine, until one is refused
            flood.append(threading.Thread(target=lambda: results.append(send(
                server, completion(LONG), KEY_A, **{"X-Request-Timeout": "8"})[0])))
            flood[-1].start()
            wait_until(lambda: bool(results) or in_engine() == len(flood))
        assert results == [503] and len(flood) == 5, (results, len(flood))  # 2 run, 2 wait
        started = time.monotonic()
        status, _, body = send(server, completion(2), KEY_B)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 2
        assert time.monotonic() - started < 5  # not behind alpha's long requests
        for thread in flood:
            thread.join(timeout=60)
        assert 503 in results and 200 in results, results  # alpha: some refused, some served
        assert metric(server, "loom:kv_integrity_violations_total") == 0


def greedy(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


def test_steps_giving_way_to_a_tenant_under_its_share_change_no_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """alpha holds every seat with long greedy requests (more wait), beta's arrive while they
    run: each starts in a step of its own, stopping the step under way where it arrives (2
    rows a step; batch-invariant, so every row's tokens are its own whatever shares a step),
    and every request's text is the one it gets alone; no KV block is lost."""
    path = tmp_path_factory.mktemp("give-way") / "tenants.toml"
    path.write_text(FLOOD_TENANTS)
    server = tiny_server(shared_tiny_model(tmp_path_factory), "--num-kv-blocks", "512",
                         "--max-num-seqs", "4", "--fair-step-rows", "2", "--batch-invariant",
                         "--tenants", str(path))
    with server.start(tmp_path_factory.mktemp("logs")):
        alpha = [f"alpha asks {index} " * 3 for index in range(6)]
        beta = [f"beta asks {index}" for index in range(3)]

        def text(prompt: str, key: str, max_tokens: int) -> str:
            status, _, body = send(server, greedy(prompt, max_tokens), key)
            assert status == 200, body
            return body["choices"][0]["text"]

        alone = {prompt: text(prompt, KEY_A, 120) for prompt in alpha}
        alone |= {prompt: text(prompt, KEY_B, 8) for prompt in beta}
        together: dict[str, str] = {}
        threads = [threading.Thread(target=lambda p=prompt: together.__setitem__(
            p, text(p, KEY_A, 120))) for prompt in alpha]
        for thread in threads:
            thread.start()
        wait_until(lambda: metric(server, "loom:num_requests_running") == 4)
        for prompt in beta:
            together[prompt] = text(prompt, KEY_B, 8)
        for thread in threads:
            thread.join(timeout=120)
        assert together == alone
        wait_until(lambda: metric(server, "loom:kv_cache_usage_perc") == 0)
        assert metric(server, "loom:kv_integrity_violations_total") == 0
