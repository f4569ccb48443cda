"""A Loom server started the way a user starts it (`python launch.py ...`), on a free port,
and the process plumbing other servers started by a benchmark share (bench.peer)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, ClassVar, Self

from common.sockets import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
PORT_ATTEMPTS = 3
READY_MARK = "[launch] serving "  # once /health answered 200 (the frontend says "serving" sooner)


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except FileNotFoundError:
        return []


def command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ").decode()


def children_by_role(launch_pid: int) -> dict[str, int]:
    """The `python -m engine` and `python -m frontend` children of a launch.py process."""
    found: dict[str, int] = {}
    for pid in child_pids(launch_pid):
        try:
            argv = command_line(pid).split()
        except OSError:
            continue  # it exited meanwhile
        if argv[1:2] == ["-m"] and argv[2:3] in (["engine"], ["frontend"]):
            found[argv[2]] = pid
    return found


def status_kib(pid: int, field_name: str) -> int | None:
    """A kB field of /proc/PID/status (VmRSS, VmHWM, ...); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(f"{field_name}:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass(kw_only=True)
class ServerProcess:
    """A server process of ours on a free port: its log in a file, started until ready,
    stopped by signal (SIGKILL when SIGTERM takes too long), a context manager."""

    port: int = 0  # 0: a free port, another if someone else binds it before the server does
    log_dir: Path | None = None  # None: a fresh temporary directory
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    log_name: ClassVar[str] = "server"

    def __post_init__(self) -> None:
        self.port_attempts = PORT_ATTEMPTS if self.port == 0 else 1
        self.port = self.port or free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def spawn(self, log: IO[bytes]) -> subprocess.Popen:
        raise NotImplementedError

    def is_ready(self) -> bool:
        raise NotImplementedError

    def send(self, signum: int) -> None:
        self.process.send_signal(signum)

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Self:
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="loom-bench-"))
        for attempt in range(1, self.port_attempts + 1):
            self.log_path = log_dir / f"{self.log_name}-{self.port}.log"
            with open(self.log_path, "wb") as log:
                self.process = self.spawn(log)
            try:
                self._wait_ready(timeout_s)
                return self
            except BaseException as error:
                self.stop()
                # A free port is free only until someone binds it (another process's
                # outgoing connection, say): a port of ours taken meanwhile is tried anew.
                if not (isinstance(error, RuntimeError) and self._port_taken()) \
                        or attempt == self.port_attempts:
                    raise
                self.port = free_port()
        return self

    def _port_taken(self) -> bool:
        return f"address ('127.0.0.1', {self.port}): address already in use" in self.log

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.log_name} exited with {self.process.returncode}:\n"
                                   f"{self._log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.log_name} not ready in {timeout_s:.0f} s:\n"
                           f"{self._log_tail()}")

    def _log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.splitlines()[-lines:])

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.send(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.send(signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


@dataclass
class LoomServer(ServerProcess):
    """launch.py drains and stops both children on SIGTERM; they die with it on SIGKILL
    (PR_SET_PDEATHSIG)."""

    launch_args: list[str] = field(default_factory=list)
    log_name: ClassVar[str] = "launch"

    def spawn(self, log: IO[bytes]) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "launch.py", "--host", "127.0.0.1", "--port", str(self.port),
             *self.launch_args],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)

    def is_ready(self) -> bool:
        return READY_MARK in self.log

    def child(self, role: str) -> int:
        """The PID of the engine or frontend process this launch.py started."""
        try:
            return children_by_role(self.process.pid)[role]
        except KeyError:
            raise LookupError(f"no {role} child of launch.py") from None
