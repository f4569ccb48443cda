"""An engine on another host: a frontend in one network namespace and a headless engine
(`launch.py --headless`) in another, joined by a veth pair, the link authenticated with a
shared secret (CURVE).

- an engine holding the wrong secret is refused, and the frontend logs it; /health stays 503
  while it is the only engine;
- an engine holding the right one joins, and a streaming request is served through it;
- killed, it is restarted by its host's launch.py and joins again, and serves again;
- as the decode engine of a prefill engine beside the frontend (--kv-roles), it takes the
  prompt's KV over the link and answers as one engine does; killed, the prefill engine
  answers alone until it joins again.

The test makes the namespaces and the veth pair and removes them; where namespaces cannot be
made (not root, no iproute2, no CAP_SYS_ADMIN) it skips, saying why. HTTP goes to the
frontend's 127.0.0.1 inside its namespace (a client run there with `ip netns exec`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from bench.launched import child_pids, command_line
from tests.launched_server import LaunchedServer
from tests.tiny_server import TINY_MODEL_NAME, shared_tiny_model

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
RPC_PORT = 23500
SECRET = "a shared secret of the test's own, 32+ bytes long"


@dataclass
class Namespaces:
    frontend: str
    engine: str
    frontend_address: str


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = os.getpid() % 100_000
    spaces = Namespaces(f"loomf{tag}", f"loome{tag}", "10.213.7.1")
    setup = [
        ["ip", "netns", "add", spaces.frontend],
        ["ip", "netns", "add", spaces.engine],
        ["ip", "link", "add", f"lf{tag}", "type", "veth", "peer", "name", f"le{tag}"],
        ["ip", "link", "set", f"lf{tag}", "netns", spaces.frontend],
        ["ip", "link", "set", f"le{tag}", "netns", spaces.engine],
        in_ns(spaces.frontend, "ip", "addr", "add", "10.213.7.1/24", "dev", f"lf{tag}"),
        in_ns(spaces.engine, "ip", "addr", "add", "10.213.7.2/24", "dev", f"le{tag}"),
        *(in_ns(ns, "ip", "link", "set", device, "up") for ns, device in (
            (spaces.frontend, f"lf{tag}"), (spaces.engine, f"le{tag}"),
            (spaces.frontend, "lo"), (spaces.engine, "lo"))),
    ]
    try:
        for command in setup:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: {' '.join(command)}: "
                            f"{done.stderr.strip()}")
        yield spaces
    finally:
        for ns in (spaces.frontend, spaces.engine):  # removing one removes its veth end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_ns(namespace: str, *command: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *command]


@dataclass
class NamespacedLaunch(LaunchedServer):
    """launch.py run inside a network namespace, with the secret in its environment."""

    namespace: str = ""
    secret: str = SECRET
    ready_mark: str = "[launch] serving "
    env: dict[str, str] = field(default_factory=dict)

    def spawn(self, log: IO[bytes]) -> subprocess.Popen:
        env = {**os.environ, "LOOM_DP_SECRET": self.secret}
        return subprocess.Popen(
            in_ns(self.namespace, sys.executable, "launch.py", "--host", "127.0.0.1",
                  "--port", str(self.port), *self.launch_args),
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def is_ready(self) -> bool:
        return self.ready_mark in self.log


CLIENT = """
import json, sys, time, urllib.error, urllib.request
base, wait_healthy = sys.argv[1], sys.argv[2] == "1"
def health():
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
if not wait_healthy:
    print(json.dumps({"health": health()}))
    sys.exit()
deadline = time.monotonic() + 120
while health() != 200 and time.monotonic() < deadline:
    time.sleep(0.1)
body = {"model": sys.argv[3], "prompt": "Hello from the other side", "max_tokens": 8,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
tokens, finish, done = None, None, False
with urllib.request.urlopen(request, timeout=60) as response:
    for line in response:
        line = line.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            for choice in event["choices"]:
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
print(json.dumps({"health": health(), "tokens": tokens, "finish": finish, "done": done}))
"""


def client(spaces: Namespaces, server: LaunchedServer, wait_healthy: bool) -> dict:
    done = subprocess.run(
        in_ns(spaces.frontend, sys.executable, "-c", CLIENT, server.base_url,
              "1" if wait_healthy else "0", TINY_MODEL_NAME),
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def engine_child(server: LaunchedServer) -> int:
    """The `python -m engine` process of a headless launch.py."""
    for pid in child_pids(server.process.pid):
        if " -m engine " in command_line(pid):
            return pid
    raise LookupError("no engine process")


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_headless_engine_in_another_namespace_serves_and_a_wrong_key_is_refused(
        namespaces: Namespaces, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = shared_tiny_model(tmp_path_factory)
    logs = tmp_path_factory.mktemp("remote-logs")
    common = ["--model", model, "--dtype", "float32", "--served-model-name", TINY_MODEL_NAME,
              "--data-parallel-size", "1", "--data-parallel-address",
              namespaces.frontend_address, "--data-parallel-rpc-port", str(RPC_PORT)]
    frontend = NamespacedLaunch([*common, "--data-parallel-size-local", "0"],
                                namespace=namespaces.frontend)
    headless = [*common, "--headless", "--num-kv-blocks", "256"]
    impostor = NamespacedLaunch(headless, namespace=namespaces.engine,
                                secret="not the secret the frontend holds, at all",
                                ready_mark="headless: ranks")
    engine = NamespacedLaunch(headless, namespace=namespaces.engine, ready_mark="headless: ranks")
    with frontend.start(logs):
        with impostor.start(logs):
            wait_for(lambda: "refused an engine" in frontend.log)
            assert client(namespaces, frontend, wait_healthy=False) == {"health": 503}
        with engine.start(logs):
            answer = client(namespaces, frontend, wait_healthy=True)
            assert "engine 0 joined" in frontend.log
            # Its host's launch.py restarts a dead engine, which joins again.
            os.kill(engine_child(engine), signal.SIGKILL)
            wait_for(lambda: "lost the connection to engine 0" in frontend.log)
            again = client(namespaces, frontend, wait_healthy=True)
            assert frontend.log.count("engine 0 joined") == 2
    assert answer == {"health": 200, "tokens": 8, "finish": "length", "done": True}
    assert again == answer


GREEDY_CLIENT = """
import json, sys, urllib.request
base, model = sys.argv[1], sys.argv[2]
prompt = [(11 * i + 5) % 300 + 10 for i in range(90)]
body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}
request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as response:
    text = json.load(response)["choices"][0]["text"]
with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
    metrics = {line.split()[0]: float(line.split()[1]) for line in response.read().decode()
               .splitlines() if line.startswith("loom:") and " " in line}
print(json.dumps({"text": text, "metrics": metrics}))
"""


def greedy_answer(base_url: str, namespace: str) -> dict:
    done = subprocess.run(in_ns(namespace, sys.executable, "-c", GREEDY_CLIENT, base_url,
                                TINY_MODEL_NAME), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_decode_engine_on_another_host_takes_the_prefill_engines_kv(
        namespaces: Namespaces, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Prefill engine beside the frontend, decode engine headless in the other namespace:
    the KV crosses the CURVE tcp link, relayed by the frontend, and the answer is one
    engine's."""
    model = shared_tiny_model(tmp_path_factory)
    logs = tmp_path_factory.mktemp("remote-pd-logs")
    common = ["--model", model, "--dtype", "float32", "--served-model-name", TINY_MODEL_NAME,
              "--data-parallel-size", "2", "--data-parallel-address",
              namespaces.frontend_address, "--data-parallel-rpc-port", str(RPC_PORT),
              "--num-kv-blocks", "256"]
    frontend = NamespacedLaunch([*common, "--data-parallel-size-local", "1",
                                 "--kv-roles", "prefill,decode"], namespace=namespaces.frontend)
    decode = NamespacedLaunch([*common, "--headless", "--data-parallel-size-local", "1",
                               "--data-parallel-start-rank", "1"],
                              namespace=namespaces.engine, ready_mark="headless: ranks")
    with frontend.start(logs), decode.start(logs):
        wait_for(lambda: "engine 1 joined" in frontend.log)
        answer = greedy_answer(frontend.base_url, namespaces.frontend)
        # The decode engine dies: the prefill engine answers whole (one engine's answer, the
        # reference) until it joins again.
        os.kill(engine_child(decode), signal.SIGKILL)
        wait_for(lambda: "lost the connection to engine 1" in frontend.log)
        without = greedy_answer(frontend.base_url, namespaces.frontend)
        wait_for(lambda: frontend.log.count("engine 1 joined") == 2)
        again = greedy_answer(frontend.base_url, namespaces.frontend)
    assert answer["text"] == without["text"] == again["text"] != ""
    handed = [reply["metrics"]["loom:prefix_cache_transfer_hits_total"]
              for reply in (answer, without, again)]
    assert handed == [80, 80, 160]  # 90 tokens: five whole blocks, sent again to the new one
    assert answer["metrics"]["loom:kv_transfer_bytes_total"] > 0
