"""Routed mixture-of-experts (Mixtral, Qwen3-MoE): a router picks each token's top-k experts
and the experts' outputs are summed with the router's weights.

The work is grouped by expert, not looped over tokens: the (token, expert) pairs are sorted
by expert, and each expert that has tokens runs one gate/up GEMM and one down GEMM over all
of them; after loading, the experts' weights take the form the linears take (packed for
oneDNN, or quantized: `replace_products`). Under tensor parallelism every rank holds a share
of each expert's intermediate columns (as the dense MLP splits) and the partial outputs are
summed. Where the grouped int4 kernel serves (bf16 on AVX512-BF16 CPUs), every expert's
projection of a kind is one `Int4Experts` and each takes one call per step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tensor_parallel import all_reduce, tp_shard
from engine.layers.activation import SiluAndMul
from engine.layers.batch_invariant import with_padded_rows
from engine.layers.linear import CheckpointTensor
from engine.quantization.int4_experts import Int4Experts
from engine.quantization.unquantized import PackedLinear, packing_applies


class Router(nn.Module):
    """Router logits [T, E]; kept in float, never quantized (as vLLM keeps it), packed for
    oneDNN where the linears are (`F.linear` on a plain bf16 weight reorders it every call)."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.packed: PackedLinear | None = None

    def pack(self) -> None:
        if self.packed is None and packing_applies(self.weight.device, self.weight.dtype):
            self.packed = PackedLinear(self.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if self.packed is None else self.packed(x)


class FusedMoE(nn.Module):
    """`expert_parts`: the checkpoint's names of an expert's gate, up and down projections
    (`experts.{e}.<name>.weight`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, expert_parts: tuple[str, str, str],
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.shard = tp_shard()
        self.span = self.shard.span(intermediate_size)
        local = self.span[1] - self.span[0]
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_parts = expert_parts
        self.out_features = hidden_size  # what `loom::linear` returns when compiled
        self.gate = Router(hidden_size, num_experts, dtype)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=dtype),
                               requires_grad=False)
        self.act = SiluAndMul()
        self.products: nn.ModuleList | None = None  # per expert: gate/up, then down
        self._calls: list[tuple[nn.Module, nn.Module]] | None = None
        self.grouped: nn.ModuleList | None = None  # gate/up and down of every expert at once

    def replace_products(self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module],
                         ) -> list[nn.Module]:
        """Each expert's gate/up and down weights become `make(weight, None)` (packed or
        quantized, engine.quantization), once; returns what `hold_products` returns."""
        if self.products is not None or self.grouped is not None:
            return []
        return self.hold_products([make(weights[expert], None)
                                   for expert in range(self.num_experts)
                                   for weights in (self.w13, self.w2)])

    def hold_products(self, made: list[nn.Module]) -> list[nn.Module]:
        """Takes every expert's layers (gate/up, down, expert after expert) in place of the
        float weights; returns them, or none where the grouped kernel serves them and they
        became two `Int4Experts` (nothing is left to attach a dense copy to)."""
        self.gate.pack()
        self.w13 = self.w2 = None  # type: ignore[assignment]
        if Int4Experts.serve(made):
            self.grouped = nn.ModuleList([Int4Experts(made[0::2]), Int4Experts(made[1::2])])
            return []
        self.products = nn.ModuleList(made)
        self._calls = list(zip(made[0::2], made[1::2], strict=True))
        return made

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self._calls is not None:
            gate_up, down = self._calls[expert]
            return down.forward(self.act.forward(gate_up.forward(x)))
        return F.linear(self.act.forward(F.linear(x, self.w13[expert])), self.w2[expert])

    def each_expert(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by expert (`counts` of each), one expert's layers at a time."""
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                out[rows] = with_padded_rows(partial(self.expert_forward, expert),
                                             grouped[rows])
                start += count
        return out

    def checkpoint_names(self, prefix: str) -> dict[str, tuple[str, tuple[int, int]]]:
        """Checkpoint name -> (parameter, (expert, part)) for every expert's projections."""
        gate, up, down = self.expert_parts
        names = {}
        for expert in range(self.num_experts):
            base = f"{prefix}experts.{expert}."
            names[f"{base}{gate}.weight"] = ("w13", (expert, 0))
            names[f"{base}{up}.weight"] = ("w13", (expert, 1))
            names[f"{base}{down}.weight"] = ("w2", (expert, 0))
        return names

    def load(self, kind: str, tensor: CheckpointTensor, part: tuple[int, int]) -> None:
        expert, half = part
        start, end = self.span
        if kind == "w13":
            local = end - start
            self.w13.data[expert, half * local:(half + 1) * local].copy_(tensor[start:end])
        else:
            self.w2.data[expert].copy_(tensor[:, start:end])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]), as transformers routes."""
        probs = torch.softmax(self.gate.forward(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, expert) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        grouped = x.index_select(0, tokens)
        if self.grouped is not None:
            starts = F.pad(counts.cumsum(0), (1, 0))
            gate_up, down = self.grouped
            out = down(self.act.forward(gate_up(grouped, starts)), starts)
        else:
            out = self.each_expert(grouped, counts.tolist())
        out *= weights.flatten().index_select(0, order)[:, None]
        summed = torch.zeros_like(x).index_add_(0, tokens, out)
        return all_reduce(summed) if self.shard.size > 1 else summed
