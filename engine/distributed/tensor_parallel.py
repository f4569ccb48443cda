"""Tensor parallelism over torch.distributed (gloo on the CPU, NCCL on CUDA).

Each rank holds a slice of every layer, as the layers declare it (engine.layers.linear,
engine.layers.embedding): whole GQA groups of attention heads and a KV cache for them, a
share of the MLP's intermediate columns, a slice of the vocabulary; row-parallel products
are summed over the ranks, the head's logits gathered. Norms and rotary tables are
replicated.

Rank 0 is the engine process: it schedules, samples and broadcasts each step's inputs
(`StepInputs`, one int64 tensor) to the other ranks (engine.distributed.tp_worker), which run
the same forward on their slices.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config import EngineConfig
from common.processes import core_slice, die_with_parent, env_for_cores
from common.sockets import free_port

logger = logging.getLogger("loom.engine")

# A collective of a step that waits longer than this for a rank fails instead of hanging.
# (A rank that dies closes its connections: the others fail at once, not at the timeout.)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
# After a failed collective, how long a rank's process gets to show that it exited.
RANK_EXIT_GRACE_S = 2.0
# Ranks 1.. wait for rank 0's next step as long as the engine stays idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class TPShard:
    rank: int
    size: int

    def span(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` items split as evenly as possible (the
        first ranks take one more)."""
        base, extra = divmod(total, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def vocab_span(self, vocab: int) -> tuple[int, int]:
        """Equal slices (the last one short): logits slices gather as equal chunks."""
        chunk = -(-vocab // self.size)
        return min(self.rank * chunk, vocab), min((self.rank + 1) * chunk, vocab)


def init_group(rank: int, size: int, master_addr: str, master_port: int,
               device: torch.device) -> None:
    """Joins the ranks through torch.distributed's TCP rendezvous. Step inputs travel as
    CPU tensors through a second, gloo group whose receives wait out any idle time."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    HOST_GROUP.clear()
    HOST_GROUP.append(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


# The group that broadcasts step inputs, made once per process by init_group.
HOST_GROUP: list[dist.ProcessGroup] = []


def host_group() -> dist.ProcessGroup:
    return HOST_GROUP[0]


def dist_backend() -> str:
    return dist.get_backend()


def tp_shard() -> TPShard:
    """This process's rank among the tensor-parallel ranks (rank 0 of 1 without them)."""
    if dist.is_available() and dist.is_initialized():
        return TPShard(dist.get_rank(), dist.get_world_size())
    return TPShard(0, 1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x`, concatenated in rank order along the last axis."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def broadcast_step(packed: torch.Tensor | None) -> None:
    """Rank 0: the step's packed inputs to every rank (None: stop)."""
    size = torch.tensor([-1 if packed is None else packed.numel()], dtype=torch.int64)
    dist.broadcast(size, 0, group=host_group())
    if packed is not None:
        dist.broadcast(packed, 0, group=host_group())


def receive_step() -> torch.Tensor | None:
    """The other ranks: the next step's packed inputs, or None when rank 0 stops."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, 0, group=host_group())
    if size.item() < 0:
        return None
    packed = torch.empty(int(size.item()), dtype=torch.int64)
    dist.broadcast(packed, 0, group=host_group())
    return packed


def broadcast_int(value: int | None = None) -> int:
    """Rank 0's `value` on every rank."""
    box = torch.tensor([value if value is not None else 0], dtype=torch.int64)
    dist.broadcast(box, 0, group=host_group())
    return int(box.item())


class RankDied(RuntimeError):
    """A tensor-parallel rank exited: the engine cannot run another step."""


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Where the ranks run: `nnodes` hosts with as many ranks each, node 0 first."""

    size: int
    nnodes: int
    node_rank: int

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def node_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def cores(self, rank: int) -> list[int] | None:
        return core_slice(rank % self.per_node, self.per_node)


def rank_layout(config: EngineConfig) -> RankLayout:
    return RankLayout(config.tensor_parallel_size, config.nnodes, config.node_rank)


@dataclass
class WorkerRanks:
    """This host's ranks other than 0, as processes of ours (engine.distributed.tp_worker)."""

    ranks: list[int]
    processes: list[subprocess.Popen]

    @classmethod
    def spawn(cls, config_json: str, layout: RankLayout, master_addr: str, master_port: int,
              log_level: str) -> WorkerRanks:
        ranks = [rank for rank in layout.node_ranks if rank != 0]
        processes = []
        for rank in ranks:
            cores = layout.cores(rank)
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "engine.distributed.tp_worker", "--config-json", config_json,
                 "--rank", str(rank), "--size", str(layout.size), "--master-addr",
                 master_addr, "--master-port", str(master_port), "--log-level", log_level],
                env=env_for_cores(os.environ, cores),
                preexec_fn=lambda cores=cores: die_with_parent(cores)))
        return cls(ranks, processes)

    def check(self) -> None:
        """Raises RankDied when a rank has exited."""
        for rank, process in zip(self.ranks, self.processes, strict=True):
            if process.poll() is not None:
                raise RankDied(f"tensor-parallel rank {rank} exited with code "
                               f"{process.returncode}")

    def explain(self, error: Exception) -> None:
        """A step's collective failed: raises RankDied (from `error`) when a rank is gone,
        which the failure usually means; returns otherwise."""
        deadline = time.monotonic() + RANK_EXIT_GRACE_S
        while time.monotonic() < deadline:
            try:
                self.check()
            except RankDied as died:
                raise died from error
            time.sleep(0.01)

    def stop(self) -> None:
        try:
            self.check()
            broadcast_step(None)
            # Every rank has the stop before the group goes: its connections close abruptly.
            dist.barrier(group=host_group())
        except RuntimeError as exc:  # a rank is gone: the others see the group break
            logger.warning("could not stop the other tensor-parallel ranks: %s", exc)
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        dist.destroy_process_group()


def keep_to_cores(rank: int, layout: RankLayout, device: torch.device) -> None:
    """On the CPU, this rank runs on its slice of the host's cores, one thread each."""
    cores = layout.cores(rank)
    if device.type == "cpu" and cores is not None:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


def start_worker_ranks(config: EngineConfig, device: torch.device,
                       log_level: str) -> WorkerRanks | None:
    """With --tensor-parallel-size N, this process is rank 0: ranks 1..N-1 start and the
    group forms; None with one rank."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    port = config.master_port or free_port()
    workers = WorkerRanks.spawn(config.to_json(), rank_layout(config), config.master_addr,
                                port, log_level)
    init_group(0, size, config.master_addr, port, device)
    logger.info("tensor parallel: %d ranks (%s)", size, dist_backend())
    return workers
