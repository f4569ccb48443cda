"""Child processes: each dies with its parent, and may keep to a slice of the cores."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1


def core_slice(index: int, count: int) -> list[int] | None:
    """Slice `index` of `count` equal slices of the cores this process may use (None when
    there are fewer cores than slices)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return None
    share = len(cores) // count
    return cores[index * share:(index + 1) * share]


def die_with_parent(cores: list[int] | None = None, own_group: bool = False) -> None:
    """For `preexec_fn`: SIGKILL when the parent dies, so nothing is ever orphaned; keep to
    `cores`; `own_group`: a process group of its own (Ctrl-C reaches the parent only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if own_group:
        os.setpgrp()
    if cores is not None:
        os.sched_setaffinity(0, cores)


def env_for_cores(base: Mapping[str, str], cores: list[int] | None) -> dict[str, str]:
    """`base` with OpenMP threads to match `cores`, unless the operator set them."""
    env = dict(base)
    if cores is not None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(len(cores))
    return env
