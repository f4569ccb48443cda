"""What the engine takes from the machine when the operator sets nothing: compute threads,
the KV cache's size and the step's token budget, from its cores, memory and CPU flags.

- Threads: every core this process may run on (its affinity: a data-parallel engine keeps to
  its slice); from 8 cores on, one is left to the frontend's tokenizing and HTTP.
- KV cache: a quarter of the memory available at start (the host's, or the cgroup's where it
  is smaller), in proportion to this process's share of the host's cores (data-parallel engines
  split it), at least 1 GiB and at most 64 GiB. Beyond its first 512 MiB, touched at start,
  the cache's pages are taken as blocks are first used (engine.platform.huge_pages).
- Token budget: 512 tokens per core with native bf16 (AVX512-BF16 or AMX), 256 without (fp32
  GEMMs run at about a third of the rate: ../PERF-NOTES), between 512 and 8192. On the 2-core
  AMX machine that is 1,024, the budget W1 measured best (docs/benchmarks.md). On CUDA:
  vLLM's online-serving default, 8,192.
- Rows of a step while tenants contend (engine.fair_share): on a CPU, 16 (a step's time grows
  with its rows: 16 rows keep a light tenant's wait near one 20 ms step on 2 cores, and run
  on kernel tapes); on CUDA no cap (a step's time barely grows with its rows).
OMP_NUM_THREADS, --kv-cache-memory / --num-kv-blocks, --max-num-batched-tokens and
--fair-step-rows override each; the engine logs what it took and why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.config import EngineConfig
from engine.platform.cpu import cpu_flags

logger = logging.getLogger("loom.engine")

GIB = 1024**3
KV_SHARE_OF_MEMORY = 0.25
KV_BYTES_RANGE = (1 * GIB, 64 * GIB)
TOKENS_PER_CORE = {True: 512, False: 256}  # by native bf16
TOKEN_BUDGET_RANGE = (512, 8192)
CUDA_TOKEN_BUDGET = 8192
CORES_FOR_THE_FRONTEND_FROM = 8
CPU_FAIR_STEP_ROWS = 16


@dataclass(frozen=True, slots=True)
class Machine:
    cores: int  # the cores this process may run on
    host_cores: int
    available_memory: int  # bytes
    native_bf16: bool

    @classmethod
    def detect(cls) -> Machine:
        flags = cpu_flags()
        host_cores = os.cpu_count() or 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else host_cores
        return cls(cores, host_cores, available_memory(),
                   bool(flags & {"avx512_bf16", "amx_bf16"}))

    @property
    def threads(self) -> int:
        return self.cores - 1 if self.cores >= CORES_FOR_THE_FRONTEND_FROM else self.cores

    @property
    def kv_cache_bytes(self) -> int:
        share = KV_SHARE_OF_MEMORY * self.available_memory * self.cores / self.host_cores
        low, high = KV_BYTES_RANGE
        return int(min(max(share, low), high))

    def token_budget(self, device: torch.device) -> int:
        if device.type == "cuda":
            return CUDA_TOKEN_BUDGET
        low, high = TOKEN_BUDGET_RANGE
        return min(max(TOKENS_PER_CORE[self.native_bf16] * self.cores, low), high)

    def describe(self) -> str:
        return (f"{self.cores} of {self.host_cores} cores, "
                f"{self.available_memory / GIB:.1f} GiB available, "
                f"{'native' if self.native_bf16 else 'no native'} bf16")


def available_memory() -> int:
    """MemAvailable, or what the cgroup still allows where that is less (0 when unknown)."""
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    if limit.isdigit():
        return min(available, max(int(limit) - used, 0)) if available else int(limit) - used
    return available


def rss_text() -> str:
    """This process's resident memory, for a log line."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return f"{int(line.split()[1]) / 1024:.0f} MiB"
    except OSError:
        pass
    return "unknown"


def take_machine_defaults(config: EngineConfig, machine: Machine,
                          device: torch.device) -> EngineConfig:
    """The token budget and (on the CPU, one rank) the thread count from the machine where
    the operator set none; one log line says which is which."""
    taken = replace(config, max_num_batched_tokens=config.max_num_batched_tokens
                    or machine.token_budget(device),
                    fair_step_rows=config.fair_step_rows or (
                        CPU_FAIR_STEP_ROWS if device.type == "cpu" else config.max_num_seqs))
    threads_set = "OMP_NUM_THREADS" in os.environ or config.tensor_parallel_size > 1
    if device.type == "cpu" and not threads_set:
        torch.set_num_threads(machine.threads)
    kv = ("set" if config.kv_cache_memory or config.num_kv_blocks
          else "80% of free CUDA memory" if device.type == "cuda"
          else f"machine: {machine.kv_cache_bytes / 2**30:.1f} GiB at most")
    logger.info("machine: %s; %d compute threads (%s), %d tokens per step (%s), KV cache "
                "size (%s)", machine.describe(), torch.get_num_threads(),
                "set" if threads_set else "machine", taken.max_num_batched_tokens,
                "set" if config.max_num_batched_tokens else "machine", kv)
    return taken
