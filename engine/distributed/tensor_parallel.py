"""Tensor parallelism over torch.distributed (gloo on the CPU, NCCL on CUDA).

Each rank holds a slice of every layer (Megatron's split):
- attention: its KV heads and their query heads (whole GQA groups; an uneven count splits
  as evenly as it can, so SmolLM2's 3 KV heads go 2 + 1 on two ranks), the qkv projection's
  rows and the output projection's columns for them, and a KV cache for its heads only;
- MLP: its share of the intermediate columns (gate and up rows, down columns);
- the output projections of both (row-parallel) sum their partial results over the ranks;
- embedding and lm_head: a slice of the vocabulary each (an id outside the slice looks up
  zeros, the sum over ranks restores it; the logits slices are gathered back in order).
Norms and rotary tables are replicated; a bias of a row-parallel layer is added by rank 0.

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
import torch.nn.functional as F
from torch import nn

from common.config import EngineConfig
from common.processes import core_slice, die_with_parent, env_for_cores

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


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


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


class RowParallel(nn.Module):
    """A linear over this rank's slice of the input features; partial sums all-reduced."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.linear.forward(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, end: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end = start, end

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = (input_ids - self.start).clamp(0, max(self.end - self.start - 1, 0))
        embedded = F.embedding(local, self.weight) * inside[:, None].to(self.weight.dtype)
        return all_reduce(embedded)


class VocabParallelHead(nn.Module):
    """lm_head over this rank's vocabulary slice; the slices gathered into full logits."""

    def __init__(self, linear: nn.Module, vocab: int, size: int) -> None:
        super().__init__()
        self.linear = linear
        self.vocab = vocab
        self.chunk = -(-vocab // size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear.forward(hidden)
        if local.shape[-1] < self.chunk:  # the last slice is short: pad to gather
            local = F.pad(local, (0, self.chunk - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[..., :self.vocab]


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                      dtype=weight.dtype, device=weight.device)
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


def shard_model(model: nn.Module, shard: TPShard) -> None:
    """Cuts a loaded (float) model down to this rank's slices, in place (see the module)."""
    config = model.config
    if config.num_key_value_heads < shard.size:
        raise ValueError(f"tensor parallel size {shard.size} exceeds the model's "
                         f"{config.num_key_value_heads} KV heads")
    for layer in model.model.layers:
        shard_attention(layer.self_attn, shard)
        shard_mlp(layer.mlp, shard)
    shard_vocab(model, shard)


def shard_attention(attention: nn.Module, shard: TPShard) -> None:
    head_dim, group = attention.head_dim, attention.num_heads // attention.num_kv_heads
    kv_start, kv_end = shard.span(attention.num_kv_heads)
    q_size, kv_size = attention.q_size, attention.kv_size
    q_rows = slice(kv_start * group * head_dim, kv_end * group * head_dim)
    kv_rows = slice(kv_start * head_dim, kv_end * head_dim)
    qkv = attention.qkv_proj

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor[q_rows], tensor[q_size:][kv_rows],
                          tensor[q_size + kv_size:][kv_rows]])

    attention.qkv_proj = linear_of(rows(qkv.weight), None if qkv.bias is None else rows(qkv.bias))
    attention.o_proj = RowParallel(row_parallel_linear(attention.o_proj, q_rows, shard))
    attention.num_kv_heads = kv_end - kv_start
    attention.num_heads = attention.num_kv_heads * group
    attention.q_size = attention.num_heads * head_dim
    attention.kv_size = attention.num_kv_heads * head_dim


def shard_mlp(mlp: nn.Module, shard: TPShard) -> None:
    size = mlp.intermediate_size
    start, end = shard.span(size)
    gate_up = mlp.gate_up_proj

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor[start:end], tensor[size + start:size + end]])

    mlp.gate_up_proj = linear_of(rows(gate_up.weight),
                                 None if gate_up.bias is None else rows(gate_up.bias))
    mlp.down_proj = RowParallel(row_parallel_linear(mlp.down_proj, slice(start, end), shard))
    mlp.intermediate_size = end - start


def row_parallel_linear(linear: nn.Linear, columns: slice, shard: TPShard) -> nn.Linear:
    bias = linear.bias if shard.rank == 0 else None
    return linear_of(linear.weight[:, columns], bias)


def shard_vocab(model: nn.Module, shard: TPShard) -> None:
    vocab = model.config.vocab_size
    start, end = shard.vocab_span(vocab)
    embedding = model.model.embed_tokens.weight
    head_weight = embedding if model.lm_head is None else model.lm_head.weight
    model.model.embed_tokens = VocabParallelEmbedding(embedding[start:end].contiguous(),
                                                      start, end)
    model.lm_head = VocabParallelHead(linear_of(head_weight[start:end], None), vocab,
                                      shard.size)


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
