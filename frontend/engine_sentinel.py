"""Notice the engine process exiting, at once: a pidfd where Linux has one, else polling."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

logger = logging.getLogger("loom.frontend.engine")

POLL_INTERVAL_S = 0.25


async def wait_for_exit(pid: int) -> None:
    """Returns once process `pid` has exited (a zombie counts as exited)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd support, or the process is already gone
        await _poll_until_gone(pid)
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _poll_until_gone(pid: int) -> None:
    while _is_running(pid):
        await asyncio.sleep(POLL_INTERVAL_S)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child its parent has not reaped yet still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[-1][:1] != "Z"
    except OSError:
        return True


async def watch_engine(pid: int, on_exit: Callable[[str], Awaitable[None]]) -> None:
    await wait_for_exit(pid)
    await on_exit(f"engine process {pid} exited")
