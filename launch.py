"""Loom launcher: spawn the engine and the frontend, hand the engine's READY to the frontend,
supervise both.

    python launch.py [--model DIR] [--host 127.0.0.1] [--port 8000] [--dtype auto] ...

Ctrl-C or SIGTERM stops every child. If the frontend or the one engine dies, the rest are
stopped and launch exits non-zero naming the cause; with several engines
(--data-parallel-size), a dead engine is restarted with backoff, and launch gives up only
when none can be kept alive.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import suppress
from dataclasses import asdict, dataclass

from common.config import EngineConfig, add_engine_args
from common.curve import SECRET_ENV, SecretMissing, load_secret
from common.processes import core_slice, die_with_parent, env_for_cores
from common.protocol import FrameError, Ready, decode
from common.sockets import Endpoints
from frontend.cli import (
    API_KEY_ENV,
    add_frontend_args,
    check_kv_roles,
    check_tenant_args,
    positive_int,
)

STOP_TIMEOUT_S = 4.0
ENGINE_READY_TIMEOUT_S = 600.0
FRONTEND_READY_TIMEOUT_S = 120.0
# Several engines: a dead one restarts after RESTART_BACKOFF_S, doubled after each restart
# that dies before READY; launch gives up once every engine has failed this many in a row.
RESTART_BACKOFF_S = 1.0
MAX_RESTART_BACKOFF_S = 30.0
MAX_FAILED_RESTARTS = 3


class ChildFailed(RuntimeError):
    """A child process died or never became ready."""


class StopRequested(Exception):
    """SIGTERM or Ctrl-C arrived."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python launch.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="local Hugging Face model directory (default: the embedded "
                             "SmolLM2-135M-Instruct, fetched and converted on first use)")
    add_frontend_args(parser)
    parser.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                        help="engine processes (replicas), each with its own KV cache and "
                             "its share of the CPU cores (or its own GPU), behind one frontend")
    parser.add_argument("--data-parallel-size-local", type=int, default=None,
                        help="engines this launch starts (default: all of them); the other "
                             "ranks run on other hosts (--headless) and connect over tcp")
    parser.add_argument("--data-parallel-start-rank", type=int, default=0,
                        help="--headless: the rank of this host's first engine")
    parser.add_argument("--data-parallel-address", default="127.0.0.1",
                        help="the frontend host's address engines on other hosts connect to "
                             "(the frontend listens there only for ranks not started here)")
    parser.add_argument("--data-parallel-rpc-port", type=int, default=13345,
                        help="rank R's engine links use ports PORT + 2R and PORT + 2R + 1")
    parser.add_argument("--data-parallel-secret-file", default=None,
                        help="the shared secret that authenticates tcp engine links (CURVE); "
                             f"default: ${SECRET_ENV} (never a command-line value)")
    parser.add_argument("--headless", action="store_true",
                        help="start engines only, connecting to a frontend on another host")
    add_engine_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    size = args.data_parallel_size
    if args.data_parallel_size_local is None:
        args.data_parallel_size_local = size - args.data_parallel_start_rank
    local, start = args.data_parallel_size_local, args.data_parallel_start_rank
    if start < 0 or local < 0 or start + local > size:
        parser.error(f"ranks {start}..{start + local - 1} are not among the "
                     f"{size} of --data-parallel-size")
    if args.headless and local == 0:
        parser.error("--headless starts engines: give --data-parallel-size-local 1 or more")
    if not args.headless and start != 0:
        parser.error("--data-parallel-start-rank is for --headless engines")
    if args.node_rank > 0 and not args.headless:
        parser.error("--node-rank above 0 runs tensor-parallel ranks only: add --headless")
    check_tenant_args(parser, args)
    check_kv_roles(parser, args, size)
    return args


def say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def describe_exit(name: str, returncode: int) -> str:
    if returncode < 0:
        return f"{name} was killed by signal {signal.Signals(-returncode).name}"
    return f"{name} exited with code {returncode}"


@dataclass(slots=True)
class EngineSlot:
    """One data-parallel rank: its addresses, its process, and its restarts."""

    rank: int
    endpoints: Endpoints
    name: str  # "engine", or "engine RANK" with several
    process: subprocess.Popen | None = None
    failed_restarts: int = 0  # in a row, each dying before READY
    restart_at: float | None = None  # monotonic time of the next restart, once it died


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        size, local = args.data_parallel_size, args.data_parallel_size_local
        start = args.data_parallel_start_rank
        ranks = range(start, start + local)
        self.engines = [EngineSlot(rank, self._tcp(rank) if args.headless
                                   else Endpoints.private_ipc(),
                                   "engine" if size == 1 else f"engine {rank}")
                        for rank in ranks]
        # Ranks on other hosts (their engines connect to the frontend's tcp sockets).
        self.remote = [] if args.headless else [self._tcp(rank) for rank in range(local, size)]
        self.restarts_engines = size > 1 or args.headless
        self.env = dict(os.environ)
        if args.headless or self.remote:
            self.env[SECRET_ENV] = load_secret(args.data_parallel_secret_file).decode()
        self.frontend: subprocess.Popen | None = None
        self.info_pipe: int | None = None  # the write end of the frontend's --engine-info-fd
        self.ready_pipes: list[int] = []
        self.config: EngineConfig | None = None
        self.stopping = False

    def _tcp(self, rank: int) -> Endpoints:
        host, port = self.args.data_parallel_address, self.args.data_parallel_rpc_port
        return Endpoints(f"tcp://{host}:{port + 2 * rank}", f"tcp://{host}:{port + 2 * rank + 1}")

    @property
    def children(self) -> dict[str, subprocess.Popen]:
        named = {slot.name: slot.process for slot in self.engines if slot.process is not None}
        if self.frontend is not None:
            named["frontend"] = self.frontend
        return named

    def spawn_engines(self, config: EngineConfig) -> None:
        """Every local rank at once (each loads the model in parallel)."""
        self.config = config
        self.ready_pipes = [self._spawn_engine(slot) for slot in self.engines]

    def await_engines(self) -> Ready | None:
        """The first local rank's READY (None when every engine runs on another host)."""
        readies = [self._await_ready(slot, pipe) for slot, pipe in zip(self.engines,
                                                                       self.ready_pipes,
                                                                       strict=True)]
        return readies[0] if readies else None

    def _spawn_engine(self, slot: EngineSlot) -> int:
        """Starts the rank's engine; returns the read end of its READY pipe."""
        assert self.config is not None
        read_fd, write_fd = os.pipe()
        command = [sys.executable, "-m", "engine", "--config-json", self.config.to_json(),
                   "--requests-addr", slot.endpoints.requests,
                   "--outputs-addr", slot.endpoints.outputs,
                   "--ready-fd", str(write_fd), "--log-level", self.args.log_level,
                   "--data-parallel-rank", str(slot.rank)]
        local, count = self.engines.index(slot), len(self.engines)
        cores = core_slice(local, count) if count > 1 else None  # several: a slice each
        slot.process = subprocess.Popen(
            command, pass_fds=(write_fd,),
            env=engine_env(self.env, local, count, cores),
            preexec_fn=lambda: die_with_parent(cores, own_group=True))
        os.close(write_fd)
        return read_fd

    def _await_ready(self, slot: EngineSlot, read_fd: int) -> Ready:
        with os.fdopen(read_fd, "rb") as ready_pipe:
            frame = self._read_ready_frame(slot.name, ready_pipe)
        try:
            ready = decode(frame)
        except FrameError as exc:
            raise ChildFailed(f"{slot.name} sent a bad READY frame: {exc}") from exc
        if not isinstance(ready, Ready):
            raise ChildFailed(f"{slot.name} sent {type(ready).__name__} instead of READY")
        return ready

    def _read_ready_frame(self, name: str, ready_pipe) -> bytes:
        deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
        chunks = []
        while time.monotonic() < deadline:
            readable, _, _ = select.select([ready_pipe], [], [], 0.2)
            if readable:
                chunk = os.read(ready_pipe.fileno(), 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            self._check_alive(name)
        if not chunks:
            self._check_alive(name)
            raise ChildFailed(f"{name} closed its READY pipe without sending READY")
        return b"".join(chunks)

    def spawn_frontend(self, model_dir: str) -> None:
        """Started beside the engines: it loads its tokenizer while they load the model, and
        waits for the first local engine's READY on a pipe (`await_frontend` sends it). With
        every engine on another host it learns what they serve from the first to connect."""
        engine_flags = []
        for slot in self.engines:
            assert slot.process is not None
            engine_flags += ["--requests-addr", slot.endpoints.requests,
                             "--outputs-addr", slot.endpoints.outputs,
                             "--engine-pid", str(slot.process.pid)]
        for endpoints in self.remote:
            engine_flags += ["--requests-addr", endpoints.requests,
                             "--outputs-addr", endpoints.outputs, "--engine-pid", "0"]
        pass_fds: tuple[int, ...] = ()
        if self.engines:
            read_fd, self.info_pipe = os.pipe()
            pass_fds = (read_fd,)
            engine_flags += ["--engine-info-fd", str(read_fd)]
        served_name = self.args.served_model_name or (
            None if self.engines else model_dir.rstrip("/").split("/")[-1])
        command = [sys.executable, "-m", "frontend", "--host", self.args.host,
                   "--port", str(self.args.port), *engine_flags,
                   "--model-dir", model_dir,
                   *(["--served-model-name", served_name] if served_name else []),
                   "--log-level", self.args.log_level,
                   "--shutdown-timeout", str(self.args.shutdown_timeout),
                   "--max-waiting-requests", str(self.args.max_waiting_requests),
                   "--max-body-bytes", str(self.args.max_body_bytes),
                   "--request-read-timeout", str(self.args.request_read_timeout),
                   "--keep-alive-timeout", str(self.args.keep_alive_timeout),
                   "--max-connections", str(self.args.max_connections),
                   "--tool-call-parser", self.args.tool_call_parser,
                   "--routing-policy", self.args.routing_policy,
                   *(["--kv-roles", self.args.kv_roles] if self.args.kv_roles else []),
                   "--pooling-type", self.args.pooling_type,
                   *(["--tenants", os.path.abspath(self.args.tenants)]
                     if self.args.tenants else []),
                   *(["--admission-control"] if self.args.admission_control else []),
                   *(["--chat-template", self.args.chat_template]
                     if self.args.chat_template else [])]
        # The key travels in the environment: a command line is visible to every local user.
        env = {name: value for name, value in self.env.items() if name != API_KEY_ENV}
        if self.args.api_key:
            env[API_KEY_ENV] = self.args.api_key
        self.frontend = subprocess.Popen(command, env=env, pass_fds=pass_fds,
                                         preexec_fn=lambda: die_with_parent(own_group=True))
        for fd in pass_fds:
            os.close(fd)

    def await_frontend(self, ready: Ready | None) -> None:
        """Sends the frontend `ready` and waits for its /health to answer."""
        if self.info_pipe is not None:
            with suppress(BrokenPipeError), os.fdopen(self.info_pipe, "wb") as pipe:
                self.info_pipe = None  # a frontend that died meanwhile is named below
                pipe.write(json.dumps(asdict(ready)).encode())
        url = f"http://{self.args.host}:{self.args.port}/health"
        deadline = time.monotonic() + FRONTEND_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for name in self.children:
                self._check_alive(name)
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError:
                if not self.engines:  # up; healthy once a remote engine joins
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
        """Raises StopRequested when asked to stop, ChildFailed when the frontend dies, when
        the one engine dies, or when, with several, no engine can be kept alive."""
        while True:
            if self.stopping:
                raise StopRequested
            if self.frontend is not None:
                self._check_alive("frontend")
            for slot in self.engines:
                if self.restarts_engines:
                    self._keep_alive(slot)
                else:
                    self._check_alive(slot.name)
            time.sleep(0.2)

    def _keep_alive(self, slot: EngineSlot) -> None:
        """Several engines: a dead one is restarted, after 1 s and twice as long after each
        restart that died before READY (30 s at most)."""
        assert slot.process is not None
        returncode = slot.process.poll()
        if returncode is None:
            return
        now = time.monotonic()
        if slot.restart_at is None:
            delay = min(RESTART_BACKOFF_S * 2**slot.failed_restarts, MAX_RESTART_BACKOFF_S)
            say(f"error: {describe_exit(slot.name, returncode)}: restarting it in {delay:.0f} s")
            slot.restart_at = now + delay
            self._give_up_if_all_failed()
        if now < slot.restart_at:
            return
        slot.restart_at = None
        try:
            self._await_ready(slot, self._spawn_engine(slot))
        except ChildFailed as exc:
            slot.failed_restarts += 1
            say(f"error: {slot.name} did not come back: {exc}")
            return
        slot.failed_restarts = 0
        say(f"{slot.name} is back (pid {slot.process.pid})")

    def _give_up_if_all_failed(self) -> None:
        if all(slot.process is not None and slot.process.poll() is not None
               and slot.failed_restarts >= MAX_FAILED_RESTARTS for slot in self.engines):
            raise ChildFailed(f"no engine could be kept alive ({MAX_FAILED_RESTARTS} restarts "
                              "of each died before READY)")

    def stop_all(self) -> None:
        if self.info_pipe is not None:  # no READY came: the frontend exits on the empty pipe
            os.close(self.info_pipe)
            self.info_pipe = None
        # The frontend goes first: it stops accepting and lets in-flight requests finish
        # (up to --shutdown-timeout) while the engines still serve them.
        # After its drain the frontend takes up to ~2 s more to abort what is left and close.
        self._stop("frontend", self.frontend, self.args.shutdown_timeout + STOP_TIMEOUT_S)
        for slot in self.engines:  # all at once, then each waited for
            if slot.process is not None and slot.process.poll() is None:
                slot.process.terminate()
        for slot in self.engines:
            self._stop(slot.name, slot.process, STOP_TIMEOUT_S / 2)
            slot.endpoints.remove()

    @staticmethod
    def _stop(name: str, child: subprocess.Popen | None, grace: float) -> None:
        """SIGTERM (again, if sent already: harmless), then SIGKILL after `grace` s."""
        if child is None or child.poll() is not None:
            return
        child.terminate()
        try:
            child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            say(f"{name} did not stop in time: killing it")
            child.kill()
            child.wait()


def engine_env(base: dict[str, str], local: int, count: int,
               cores: list[int] | None) -> dict[str, str]:
    """Threads to match the cores; with several engines on this host's GPUs, one GPU each
    (`local`: the engine's index among this host's `count`)."""
    env = env_for_cores(base, cores)
    if count > 1:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(count)]
        env["CUDA_VISIBLE_DEVICES"] = devices[local % len(devices)]
    return env


def serve_tensor_parallel_ranks(args: argparse.Namespace, model_dir: str) -> int:
    """A node other than 0 of a tensor-parallel engine: its ranks join node 0's rendezvous
    and run until the engine stops them (exit 0) or the group breaks (non-zero)."""
    from engine.distributed.tensor_parallel import WorkerRanks, rank_layout

    try:
        config = EngineConfig.from_args(args, model_dir)
    except ValueError as exc:
        say(f"error: {exc}")
        return 2
    layout = rank_layout(config)
    workers = WorkerRanks.spawn(config.to_json(), layout, config.master_addr,
                                config.master_port or 0, args.log_level)
    say(f"tensor-parallel ranks {layout.node_ranks.start}..{layout.node_ranks.stop - 1} "
        f"joining {config.master_addr}:{config.master_port}")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    while not stopping and all(process.poll() is None for process in workers.processes):
        time.sleep(0.2)
    for process in workers.processes:
        if process.poll() is None:
            process.terminate()
    codes = [process.wait() for process in workers.processes]
    say(f"tensor-parallel ranks stopped: exit codes {codes}")
    return 0 if stopping or not any(codes) else 1


def resolve_draft_model(speculative_json: str | None) -> None:
    """A draft model that cannot be served fails here, as the served model does, not in the
    engine after the target's weights loaded."""
    from common.default_model import resolve_model
    from common.speculative import SpeculativeConfig

    if speculative_json is None:
        return
    speculative = SpeculativeConfig.parse(speculative_json)
    if speculative.method == "draft_model":
        try:
            resolve_model(speculative.model, progress=say)
        except ValueError as exc:
            raise ValueError(f"--speculative-config: the draft model: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.default_model import is_hub_id, resolve_model

    if args.headless and args.node_rank > 0:
        try:
            model_dir = resolve_model(args.model, progress=say)
        except ValueError as exc:
            say(f"error: {exc}")
            return 2
        return serve_tensor_parallel_ranks(args, model_dir)
    try:
        launcher = Launcher(args)
    except (SecretMissing, OSError) as exc:
        say(f"error: {exc}")
        return 2

    def request_stop(signum: int, _frame) -> None:
        say(f"received {signal.Signals(signum).name}: stopping")
        launcher.stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    started = time.monotonic()
    try:
        model_dir = resolve_model(args.model, progress=say)
        resolve_draft_model(args.speculative_config)
    except ValueError as exc:  # a model that cannot be served: the reason, no traceback
        say(f"error: {exc}")
        return 2
    if args.served_model_name is None and is_hub_id(args.model):
        args.served_model_name = args.model  # not the snapshot's commit hash
    try:
        config = EngineConfig.from_args(args, model_dir)
        launcher.spawn_engines(config)
        if not args.headless:
            launcher.spawn_frontend(model_dir)
        ready = launcher.await_engines()
        local = args.data_parallel_size_local
        if ready is not None:
            engines = "engine" if local == 1 else f"{local} engines"
            say(f"{engines} ready in {time.monotonic() - started:.1f} s: {ready.model_name}, "
                f"{ready.num_kv_blocks} KV blocks of {ready.block_size} tokens"
                f"{' each' if local > 1 else ''}, max model len {ready.max_model_len}")
        if args.headless:
            say(f"headless: ranks {args.data_parallel_start_rank}.."
                f"{args.data_parallel_start_rank + local - 1} connect to the frontend at "
                f"{args.data_parallel_address}")
        else:
            launcher.await_frontend(ready)
            awaited = "" if ready is not None else "; waiting for engines on other hosts"
            say(f"serving {ready.model_name if ready else model_dir} at "
                f"http://{args.host}:{args.port}/v1 (ready in "
                f"{time.monotonic() - started:.1f} s{awaited})")
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
