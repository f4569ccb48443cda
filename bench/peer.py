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
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import IO, ClassVar

from bench.launched import ServerProcess


@dataclass
class PeerServer(ServerProcess):
    command: str = ""  # a shell-free template: "{port}" is replaced by `port`
    log_name: ClassVar[str] = "peer"

    @property
    def argv(self) -> list[str]:
        return [part.replace("{port}", str(self.port)) for part in shlex.split(self.command)]

    def spawn(self, log: IO[bytes]) -> subprocess.Popen:
        if "{port}" not in self.command:
            raise ValueError(f"the peer command has no {{port}} to fill: {self.command!r}")
        return subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def send(self, signum: int) -> None:
        """To the peer's whole session: the session we created has our child's pid as id."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def stop(self) -> int | None:
        returncode = super().stop()
        if self.process is not None:
            self.send(signal.SIGKILL)  # children that outlived their parent
        return returncode
