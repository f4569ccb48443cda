"""Start Loom the way a user does (`python launch.py ...`) on a free port, and clean up after."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.launched import READY_TIMEOUT_S, LoomServer


def process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


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
