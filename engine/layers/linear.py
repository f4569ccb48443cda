"""Linear layers that declare how tensor parallelism splits them and which checkpoint tensors
they are made of (Megatron's split, as nano-vllm's and vLLM's layers declare it).

A model builds each linear at this rank's size and the loader hands every checkpoint tensor to
its layer's `load`, which takes only this rank's rows or columns (a safetensors slice reads
only those from disk). Merged projections (q/k/v, gate/up) name their parts: the loader maps
the checkpoint's names onto them from that declaration alone. After loading, quantization or
packing (engine.quantization) replaces each layer by the module that multiplies its weight,
keeping what the declaration adds around the product (`wrap`: the all-reduce of a
row-parallel layer, the gather of the vocabulary-parallel head).

- QKVParallelLinear: whole GQA groups per rank (an uneven KV-head count splits as evenly as
  it can: 3 KV heads go 2 + 1 on two ranks), q, k and v rows for them.
- MergedColumnParallelLinear: each part's share of the output rows (gate and up).
- RowParallelLinear: a share of the input columns; partial sums all-reduced; the bias added
  by rank 0 only.
- ParallelLMHead: a slice of the vocabulary's rows; the logits slices gathered in order.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tensor_parallel import TPShard, all_gather, all_reduce, tp_shard


class CheckpointTensor(Protocol):
    """A tensor of the checkpoint, read (in part) only when sliced."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: object) -> torch.Tensor: ...


class LinearBase(nn.Linear):
    """y = x Wᵀ + b at this rank's size. `parts`: the checkpoint's projections stacked into
    this one (empty: the checkpoint names this module itself)."""

    parts: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype | None, shard: TPShard) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.shard = shard
        self.requires_grad_(False)

    def load(self, kind: str, tensor: CheckpointTensor, part: int | None) -> None:
        """`kind` "weight" or "bias" of the checkpoint (of part `part` of `parts`)."""
        target = self.weight if kind == "weight" else self.bias
        assert target is not None
        rows = self.part_rows(part, target.shape[0])
        target.data[rows].copy_(self.local(kind, tensor, part))

    def part_rows(self, part: int | None, total: int) -> slice:
        """This layer's output rows that part `part` fills."""
        return slice(0, total)

    def local(self, kind: str, tensor: CheckpointTensor, part: int | None) -> torch.Tensor:
        """This rank's piece of a checkpoint tensor."""
        return tensor[:]

    def wrap(self, product: nn.Module) -> nn.Module:
        """What replaces this layer once `product` multiplies its weight."""
        return product


class MergedColumnParallelLinear(LinearBase):
    """Several projections of one input stacked by rows, each split over the ranks."""

    def __init__(self, in_features: int, part_sizes: list[int], parts: tuple[str, ...],
                 bias: bool = False, dtype: torch.dtype | None = None,
                 spans: list[tuple[int, int]] | None = None) -> None:
        """`parts` empty: the checkpoint holds the stacked tensor itself (Phi-3). `spans`:
        this rank's rows of each part (by default each part split as evenly as it can)."""
        shard = tp_shard()
        self.part_sizes = part_sizes
        self.spans = spans or [shard.span(size) for size in part_sizes]
        local = [end - start for start, end in self.spans]
        super().__init__(in_features, sum(local), bias, dtype, shard)
        self.parts = parts
        self.offsets = [sum(local[:i]) for i in range(len(local) + 1)]

    def load(self, kind: str, tensor: CheckpointTensor, part: int | None) -> None:
        if part is not None:
            super().load(kind, tensor, part)
            return
        start_in_checkpoint = 0
        for index, size in enumerate(self.part_sizes):  # each part's share of the stack
            super().load(kind, _Rows(tensor, start_in_checkpoint), index)
            start_in_checkpoint += size

    def part_rows(self, part: int | None, total: int) -> slice:
        assert part is not None
        return slice(self.offsets[part], self.offsets[part + 1])

    def local(self, kind: str, tensor: CheckpointTensor, part: int | None) -> torch.Tensor:
        assert part is not None
        start, end = self.spans[part]
        return tensor[start:end]


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections; each rank holds whole GQA groups: its KV heads and their
    query heads (`num_heads`, `num_kv_heads` are this rank's)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None,
                 parts: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")) -> None:
        shard = tp_shard()
        if num_kv_heads < shard.size:
            raise ValueError(f"tensor parallel size {shard.size} exceeds the model's "
                             f"{num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        kv_start, kv_end = shard.span(num_kv_heads)
        self.num_kv_heads = kv_end - kv_start
        self.num_heads = self.num_kv_heads * group
        self.head_dim = head_dim
        q_span = (kv_start * group * head_dim, kv_end * group * head_dim)
        kv_span = (kv_start * head_dim, kv_end * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], parts, bias, dtype,
                         spans=[q_span, kv_span, kv_span])


class _Rows:
    """A stacked checkpoint tensor seen from row `start` on: one part of it, sliced lazily."""

    def __init__(self, tensor: CheckpointTensor, start: int) -> None:
        self.tensor, self.start = tensor, start

    def __getitem__(self, index: slice) -> torch.Tensor:
        return self.tensor[self.start + index.start:self.start + index.stop]


class RowParallelLinear(LinearBase):
    """A share of the input features, in whole units of `unit` features (an attention output
    splits by query groups, as its QKVParallelLinear does); the partial products summed."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, unit: int = 1) -> None:
        shard = tp_shard()
        start, end = shard.span(in_features // unit)
        self.span = (start * unit, end * unit)
        super().__init__(self.span[1] - self.span[0], out_features,
                         bias and shard.rank == 0, dtype, shard)
        self.bias_in_checkpoint = bias

    def local(self, kind: str, tensor: CheckpointTensor, part: int | None) -> torch.Tensor:
        return tensor[:, self.span[0]:self.span[1]] if kind == "weight" else tensor[:]

    def load(self, kind: str, tensor: CheckpointTensor, part: int | None) -> None:
        if kind == "bias" and self.bias is None:  # another rank adds it
            return
        super().load(kind, tensor, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return all_reduce(y) if self.shard.size > 1 else y

    def wrap(self, product: nn.Module) -> nn.Module:
        return AllReduced(product) if self.shard.size > 1 else product


class ParallelLMHead(LinearBase):
    """The output projection over this rank's slice of the vocabulary (equal slices, the last
    one short, so the logits gather as equal chunks)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 ) -> None:
        shard = tp_shard()
        self.vocab_size = vocab_size
        self.span = shard.vocab_span(vocab_size)
        super().__init__(hidden_size, self.span[1] - self.span[0], False, dtype, shard)

    def local(self, kind: str, tensor: CheckpointTensor, part: int | None) -> torch.Tensor:
        return tensor[self.span[0]:self.span[1]]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return gather_vocab(logits, self.vocab_size, self.shard) if self.shard.size > 1 \
            else logits

    def wrap(self, product: nn.Module) -> nn.Module:
        return GatheredVocab(product, self.vocab_size, self.shard) if self.shard.size > 1 \
            else product


class AllReduced(nn.Module):
    """A row-parallel product: the partial sums of every rank added up."""

    def __init__(self, product: nn.Module) -> None:
        super().__init__()
        self.linear = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.linear.forward(x).contiguous())


class GatheredVocab(nn.Module):
    """The head's vocabulary slices gathered into whole logits."""

    def __init__(self, product: nn.Module, vocab_size: int, shard: TPShard) -> None:
        super().__init__()
        self.linear = product
        self.vocab_size = vocab_size
        self.shard = shard

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab(self.linear.forward(hidden), self.vocab_size, self.shard)


def gather_vocab(local: torch.Tensor, vocab_size: int, shard: TPShard) -> torch.Tensor:
    """Every rank's logits slice, in order: [..., vocab_size]."""
    chunk = -(-vocab_size // shard.size)
    if local.shape[-1] < chunk:  # the last slice is short: pad to gather
        local = F.pad(local, (0, chunk - local.shape[-1]))
    return all_gather(local.contiguous())[..., :vocab_size]
