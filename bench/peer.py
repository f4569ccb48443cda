"""Another server (vLLM, llama.cpp, ...) started from a command line, fresh for each cell.

The command is a template: `{port}` becomes a free port. The server runs in a session of its
own, so stopping it ends everything it spawned (vLLM starts an engine-core child) and nothing
else. Ready means `GET /v1/models` answers 200.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from bench.launched import READY_TIMEOUT_S, STOP_TIMEOUT_S, free_port

POLL_INTERVAL_S = 0.5


@dataclass
class PeerServer:
    command: str  # a shell-free template: "{port}" is replaced by `port`
    port: int = field(default_factory=free_port)
    log_dir: Path | None = None
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def argv(self) -> list[str]:
        return [part.replace("{port}", str(self.port)) for part in shlex.split(self.command)]

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> PeerServer:
        if "{port}" not in self.command:
            raise ValueError(f"the peer command has no {{port}} to fill: {self.command!r}")
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="loom-peer-"))
        self.log_path = log_dir / f"peer-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"peer exited with {self.process.returncode}:\n"
                                   f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"peer not ready in {timeout_s:.0f} s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM to the peer's session, SIGKILL to it if that takes too long."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._signal_session(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal_session(signal.SIGKILL)
                self.process.wait()
        self._signal_session(signal.SIGKILL)  # children that outlived their parent
        return self.process.returncode

    def _signal_session(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)  # the session we created: its id is our pid

    def __enter__(self) -> PeerServer:
        return self.start() if self.process is None else self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
