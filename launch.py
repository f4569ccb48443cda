"""Loom launcher: spawn the engine, wait for its READY, spawn the frontend, supervise both.

    python launch.py [--model DIR] [--host 127.0.0.1] [--port 8000] [--dtype auto] ...

Ctrl-C or SIGTERM stops both children; if either dies, the other is stopped and launch
exits non-zero naming the cause.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict

from common.config import EngineConfig, add_chat_args, add_engine_args
from common.protocol import FrameError, Ready, decode
from common.sockets import Endpoints

STOP_TIMEOUT_S = 4.0
API_KEY_ENV = "LOOM_API_KEY"
ENGINE_READY_TIMEOUT_S = 600.0
FRONTEND_READY_TIMEOUT_S = 120.0


class ChildFailed(RuntimeError):
    """A child process died or never became ready."""


class StopRequested(Exception):
    """SIGTERM or Ctrl-C arrived."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python launch.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="local Hugging Face model directory (default: the embedded "
                             "SmolLM2-135M-Instruct, fetched and converted on first use)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--shutdown-timeout", type=float, default=3.0,
                        help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                             f"(default: ${API_KEY_ENV}; /health and /metrics stay open)")
    parser.add_argument("--max-waiting-requests", type=positive_int, default=1024,
                        help="requests waiting for the engine (each of n choices counts) "
                             "beyond which new ones get 503 with Retry-After")
    parser.add_argument("--max-body-bytes", type=positive_int, default=32 * 1024 * 1024,
                        help="largest request body accepted; larger ones get 413")
    add_chat_args(parser)
    add_engine_args(parser)
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Children get SIGKILL if launch itself is killed, so nothing is ever orphaned."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    os.setpgrp()  # Ctrl-C reaches launch only; launch stops the children in order.


def describe_exit(name: str, returncode: int) -> str:
    if returncode < 0:
        return f"{name} was killed by signal {signal.Signals(-returncode).name}"
    return f"{name} exited with code {returncode}"


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.endpoints = Endpoints.private_ipc()
        self.children: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def start_engine(self, config: EngineConfig) -> Ready:
        read_fd, write_fd = os.pipe()
        command = [sys.executable, "-m", "engine", "--config-json", config.to_json(),
                   "--requests-addr", self.endpoints.requests,
                   "--outputs-addr", self.endpoints.outputs,
                   "--ready-fd", str(write_fd), "--log-level", self.args.log_level]
        self.children["engine"] = subprocess.Popen(
            command, pass_fds=(write_fd,), preexec_fn=_die_with_parent)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as ready_pipe:
            frame = self._read_ready_frame(ready_pipe)
        try:
            ready = decode(frame)
        except FrameError as exc:
            raise ChildFailed(f"engine sent a bad READY frame: {exc}") from exc
        if not isinstance(ready, Ready):
            raise ChildFailed(f"engine sent {type(ready).__name__} instead of READY")
        return ready

    def _read_ready_frame(self, ready_pipe) -> bytes:
        deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
        chunks = []
        while time.monotonic() < deadline:
            readable, _, _ = select.select([ready_pipe], [], [], 0.2)
            if readable:
                chunk = os.read(ready_pipe.fileno(), 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            self._check_alive("engine")
        if not chunks:
            self._check_alive("engine")
            raise ChildFailed("engine closed its READY pipe without sending READY")
        return b"".join(chunks)

    def start_frontend(self, model_dir: str, ready: Ready) -> None:
        command = [sys.executable, "-m", "frontend", "--host", self.args.host,
                   "--port", str(self.args.port),
                   "--requests-addr", self.endpoints.requests,
                   "--outputs-addr", self.endpoints.outputs,
                   "--model-dir", model_dir, "--served-model-name", ready.model_name,
                   "--engine-info", json.dumps(asdict(ready)),
                   "--log-level", self.args.log_level,
                   "--shutdown-timeout", str(self.args.shutdown_timeout),
                   "--max-waiting-requests", str(self.args.max_waiting_requests),
                   "--max-body-bytes", str(self.args.max_body_bytes),
                   "--tool-call-parser", self.args.tool_call_parser,
                   *(["--chat-template", self.args.chat_template]
                     if self.args.chat_template else []),
                   "--engine-pid", str(self.children["engine"].pid)]
        # The key travels in the environment: a command line is visible to every local user.
        env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
        if self.args.api_key:
            env[API_KEY_ENV] = self.args.api_key
        self.children["frontend"] = subprocess.Popen(command, env=env,
                                                     preexec_fn=_die_with_parent)
        url = f"http://{self.args.host}:{self.args.port}/health"
        deadline = time.monotonic() + FRONTEND_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_alive("frontend")
            self._check_alive("engine")
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise ChildFailed(f"frontend did not answer {url} within {FRONTEND_READY_TIMEOUT_S} s")

    def _check_alive(self, name: str) -> None:
        if self.stopping:
            raise StopRequested
        returncode = self.children[name].poll()
        if returncode is not None:
            raise ChildFailed(describe_exit(name, returncode))

    def supervise(self) -> None:
        """Raises StopRequested when asked to stop, ChildFailed when a child dies."""
        while True:
            for name in self.children:
                self._check_alive(name)
            time.sleep(0.2)

    def stop_all(self) -> None:
        # The frontend goes first: it stops accepting and lets in-flight requests finish
        # (up to --shutdown-timeout) while the engine still serves them.
        # After its drain the frontend takes up to ~2 s more to abort what is left and close.
        grace = {"frontend": self.args.shutdown_timeout + STOP_TIMEOUT_S,
                 "engine": STOP_TIMEOUT_S / 2}
        for name in ("frontend", "engine"):
            child = self.children.get(name)
            if child is None or child.poll() is not None:
                continue
            child.terminate()
            try:
                child.wait(timeout=grace[name])
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop in time: killing it")
                child.kill()
                child.wait()
        self.endpoints.remove()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.default_model import is_hub_id, resolve_model

    launcher = Launcher(args)

    def request_stop(signum: int, _frame) -> None:
        say(f"received {signal.Signals(signum).name}: stopping")
        launcher.stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    started = time.monotonic()
    try:
        model_dir = resolve_model(args.model, progress=say)
    except ValueError as exc:  # a model that cannot be served: the reason, no traceback
        say(f"error: {exc}")
        return 2
    if args.served_model_name is None and is_hub_id(args.model):
        args.served_model_name = args.model  # not the snapshot's commit hash
    try:
        config = EngineConfig.from_args(args, model_dir)
        ready = launcher.start_engine(config)
        say(f"engine ready in {time.monotonic() - started:.1f} s: {ready.model_name}, "
            f"{ready.num_kv_blocks} KV blocks of {ready.block_size} tokens, "
            f"max model len {ready.max_model_len}")
        launcher.start_frontend(model_dir, ready)
        say(f"serving {ready.model_name} at http://{args.host}:{args.port}/v1 "
            f"(ready in {time.monotonic() - started:.1f} s)")
        launcher.supervise()
    except StopRequested:
        pass
    except ChildFailed as exc:
        say(f"error: {exc}")
        launcher.stop_all()
        return 1
    except Exception as exc:
        say(f"error: {exc}")
        launcher.stop_all()
        raise
    launcher.stop_all()
    say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
