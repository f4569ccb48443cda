"""The engine as a real process over real ZeroMQ sockets: READY, serving, bad frames, shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from common.config import EngineConfig
from common.protocol import (
    PROTOCOL_VERSION,
    AddRequest,
    Ready,
    RequestError,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from common.sampling import SamplingParams
from common.sockets import Endpoints, make_socket
from engine.__main__ import StopOnSigterm
from engine.server import EngineServer
from tests.model_fixtures import build_tiny_llama_dir

RECV_TIMEOUT_MS = 30_000


@pytest.fixture
def engine_process(tmp_path):
    model_dir = build_tiny_llama_dir(tmp_path / "model")
    endpoints = Endpoints.private_ipc()
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", max_model_len=128,
                          kv_cache_memory=16 * 1024**2)
    read_fd, write_fd = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "engine", "--config-json", config.to_json(),
         "--requests-addr", endpoints.requests, "--outputs-addr", endpoints.outputs,
         "--ready-fd", str(write_fd)],
        pass_fds=(write_fd,), stderr=subprocess.PIPE, text=True)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready_pipe:
        ready = decode(ready_pipe.read())
    context = zmq.Context()
    requests = make_socket(context, zmq.PUSH, endpoints.requests, bind=False)
    outputs = make_socket(context, zmq.PULL, endpoints.outputs, bind=False)
    outputs.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    try:
        yield ready, requests, outputs, process
    finally:
        requests.close(linger=0)
        outputs.close(linger=0)
        context.term()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        endpoints.remove()


def collect(outputs: zmq.Socket, request_id: str) -> tuple[list[int], str]:
    tokens: list[int] = []
    while True:
        message = decode(outputs.recv())
        if isinstance(message, RequestError):
            assert message.request_id == request_id
            return tokens, f"error: {message.reason}"
        assert isinstance(message, StepOutputs)
        for output in message.outputs:
            if output.request_id == request_id:
                tokens.extend(output.new_token_ids)
                if output.finish_reason:
                    return tokens, output.finish_reason


def add(request_id: str, prompt: list[int], max_tokens: int) -> bytes:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return encode(AddRequest(request_id, prompt, params, 0.0))


def test_ready_carries_model_facts(engine_process):
    ready, *_ = engine_process
    assert isinstance(ready, Ready)
    assert ready.max_model_len == 128 and ready.block_size == 16
    assert ready.num_kv_blocks > 0 and ready.vocab_size > 0


def test_bad_frames_are_dropped_and_the_engine_keeps_serving(engine_process):
    _, requests, outputs, process = engine_process
    for garbage in [b"\xc1garbage", msgpack.packb([PROTOCOL_VERSION, 99]),
                    msgpack.packb([PROTOCOL_VERSION + 1, 3]),
                    encode(Ready("x", 1, 1, 1, [], 1))]:
        requests.send(garbage)
    requests.send(add("after-garbage", [5, 6, 7], max_tokens=5))
    tokens, reason = collect(outputs, "after-garbage")
    assert len(tokens) == 5 and reason == "length"
    requests.send(encode(Shutdown()))
    assert process.wait(timeout=30) == 0
    log = process.stderr.read()
    assert log.count("dropped a") == 4


def test_an_unreadable_request_gets_an_error_frame_not_silence(engine_process):
    _, requests, outputs, _ = engine_process
    frame = msgpack.unpackb(add("unreadable", [3, 4], max_tokens=2))
    frame[4]["bogus"] = 1  # a sampling field no engine knows
    requests.send(msgpack.packb(frame))
    tokens, reason = collect(outputs, "unreadable")
    assert tokens == [] and "unknown sampling fields" in reason
    requests.send(add("fine", [3, 4], max_tokens=2))
    assert collect(outputs, "fine")[1] == "length"


def test_an_impossible_request_gets_an_error_frame(engine_process):
    _, requests, outputs, _ = engine_process
    requests.send(add("too-long", list(range(3, 103)), max_tokens=100))
    tokens, reason = collect(outputs, "too-long")
    assert tokens == [] and "maximum model length of 128" in reason
    requests.send(add("fine", [3, 4], max_tokens=2))
    tokens, reason = collect(outputs, "fine")
    assert len(tokens) == 2 and reason == "length"


def test_going_idle_sends_stats_at_rest(engine_process):
    _, requests, outputs, _ = engine_process
    requests.send(add("short", [3, 4, 5], max_tokens=3))
    collect(outputs, "short")
    idle = decode(outputs.recv())
    assert isinstance(idle, StepOutputs) and idle.outputs == []
    assert idle.stats.num_running == 0 and idle.stats.num_waiting == 0
    assert idle.stats.kv_integrity_violations_total == 0 and idle.stats.at_rest


@pytest.mark.parametrize("busy", [True, False], ids=["mid-generation", "idle"])
def test_sigterm_ends_the_loop_and_the_process_in_order(engine_process, busy: bool):
    """SIGTERM ends the serving loop after its step or poll (no exception thrown into
    whatever the main thread was doing): exit status 0, no traceback."""
    _, requests, outputs, process = engine_process
    if busy:
        requests.send(add("long", [3, 4, 5], max_tokens=100))
        assert isinstance(decode(outputs.recv()), StepOutputs)  # it is stepping
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert "Traceback" not in process.stderr.read()


def test_a_sigterm_handler_that_raises_only_before_the_loop_serves():
    stop = StopOnSigterm()
    with pytest.raises(SystemExit):
        stop(signal.SIGTERM, None)
    stops = []
    stop.server = SimpleNamespace(stop=lambda: stops.append(True))
    stop(signal.SIGTERM, None)  # must not raise: a swallowed exception kept engines alive
    assert stops == [True]


def test_stop_ends_an_idle_wait_for_requests_at_once():
    endpoints = Endpoints.private_ipc()
    server = EngineServer(SimpleNamespace(), endpoints.requests, endpoints.outputs)
    try:
        server.stop()
        started = time.monotonic()
        assert not server._requests_arrived(timeout_ms=60_000)
        assert time.monotonic() - started < 30  # the wake-up, not the poll's timeout
        assert not server.running
    finally:
        server.close()
        endpoints.remove()


def test_stop_after_close_does_nothing():
    """A second SIGTERM while a tensor-parallel engine shut down reached `stop` after `close`:
    its write to the closed wake-up pipe raised in the middle of the ranks' stop broadcast,
    and rank 1 lost its peer (exit 1)."""
    endpoints = Endpoints.private_ipc()
    server = EngineServer(SimpleNamespace(), endpoints.requests, endpoints.outputs)
    try:
        server.close()
        server.stop()
        assert not server.running
    finally:
        endpoints.remove()


def test_a_server_whose_sockets_fail_to_open_leaves_no_context_behind(monkeypatch, tmp_path):
    """Its requests socket bound, its outputs socket refused: the open socket would make the
    context's garbage collection wait on it for ever (a test run once hung on that)."""
    contexts: list[zmq.Context] = []

    class RecordedContext(zmq.Context):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            contexts.append(self)

    monkeypatch.setattr(zmq, "Context", RecordedContext)
    endpoints = Endpoints.private_ipc()
    try:
        with pytest.raises(zmq.ZMQError):
            EngineServer(SimpleNamespace(), endpoints.requests,
                         f"ipc://{tmp_path}/no-such-directory/outputs")
    finally:
        endpoints.remove()
    assert len(contexts) == 1 and contexts[0].closed
