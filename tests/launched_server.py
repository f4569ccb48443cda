"""Start Loom the way a user does (`python launch.py ...`) on a free port, and clean up after."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.launched import READY_TIMEOUT_S, LoomServer


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except FileNotFoundError:
        return []


def process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ").decode()


@dataclass
class LaunchedServer(LoomServer):
    """bench.launched's server, plus what tests ask of a running one."""

    def start(self, log_dir: Path) -> LaunchedServer:  # type: ignore[override]
        self.log_dir = log_dir
        super().start(READY_TIMEOUT_S)
        return self

    def health_status(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    def child(self, module: str) -> int:
        for pid in child_pids(self.process.pid):
            if f"-m {module} " in command_line(pid):
                return pid
        raise LookupError(f"no {module} child of launch.py")
