"""Routed mixture-of-experts (Mixtral, Qwen3-MoE): a router picks each token's top-k experts
and the experts' outputs are summed with the router's weights.

The work is grouped by expert, not looped over tokens: the (token, expert) pairs are sorted
by expert, and each expert that has tokens runs one gate/up GEMM and one down GEMM over all
of them; after loading, the experts' weights take the form the linears take (packed for
oneDNN, or quantized: `replace_products`). Under tensor parallelism every rank holds a share
of each expert's intermediate columns (as the dense MLP splits) and the partial outputs are
summed. Where the grouped int4 kernel serves (bf16 on AVX512-BF16 CPUs), every expert's
projection of a kind is one `Int4Experts` and takes one call per step; otherwise a layer per
expert (`EachExpert`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tensor_parallel import all_reduce, tp_shard
from engine.kernels.moe_int4 import combine_experts, group_by_expert
from engine.layers.activation import SiluAndMul
from engine.layers.batch_invariant import with_padded_rows
from engine.layers.linear import CheckpointTensor
from engine.quantization.base import QuantizedLinear
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


class EachExpert(nn.Module):
    """One projection of every expert as a layer per expert (packed or quantized, see
    engine.quantization): rows grouped by expert (`counts` [E] of each), one layer at a time.
    Quantized experts keep no dense copy: their codes' kernels take every step (copies of every
    expert would cost more memory than the codes save: 4 bytes a weight in fp32)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        for layer in layers:
            if isinstance(layer, QuantizedLinear):
                layer.keeps_dense_copy = False
        self.layers = nn.ModuleList(layers)
        self._calls = list(layers)  # plain list: no nn.Module __getattr__ per expert
        self.out_features = layers[0].out_features

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return rows_by_expert(self._calls, x, counts.tolist(), self.out_features)


def rows_by_expert(multiplies: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                   x: torch.Tensor, counts: list[int], out_features: int) -> torch.Tensor:
    """Rows grouped by expert (`counts` of each), each expert's rows through its `multiplies`
    entry (padded where the step asks for it: engine.layers.batch_invariant)."""
    out = x.new_empty((x.shape[0], out_features))
    start = 0
    for multiply, count in zip(multiplies, counts, strict=True):
        if count:
            out[start:start + count] = with_padded_rows(multiply, x[start:start + count])
            start += count
    return out


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
        # Once the weights are packed or quantized: gate/up, then down, of every expert, each
        # an `Int4Experts` (one kernel call) or an `EachExpert`.
        self.projections: nn.ModuleList | None = None

    def replace_products(self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module],
                         ) -> list[nn.Module]:
        """Each expert's gate/up and down weights become `make(weight, None)` (packed or
        quantized, engine.quantization), once; returns what `hold_products` returns."""
        if self.projections is not None:
            return []
        experts = range(self.num_experts)
        return self.hold_products([make(self.w13[expert], None) for expert in experts],
                                  [make(self.w2[expert], None) for expert in experts])

    def hold_products(self, gate_up: list[nn.Module], down: list[nn.Module]) -> list[nn.Module]:
        """Takes every expert's gate/up and down layers in place of the float weights. Where
        the grouped kernel serves a projection's layers they become one `Int4Experts`; returns
        the layers kept one per expert (those a dense copy may attach to)."""
        self.gate.pack()
        self.w13 = self.w2 = None  # type: ignore[assignment]
        kept: list[nn.Module] = []
        projections = []
        for layers in (gate_up, down):
            if Int4Experts.serve(layers):
                projections.append(Int4Experts(layers))
            else:
                projections.append(EachExpert(layers))
                kept.extend(layers)
        self.projections = nn.ModuleList(projections)
        return kept

    @property
    def kernel_grouping(self) -> bool:
        """Whether a projection is one `Int4Experts`: then rows are grouped and summed in C++."""
        return self.projections is not None and any(
            isinstance(projection, Int4Experts) for projection in self.projections)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's float weights (before any packing or quantization)."""
        return F.linear(self.act.forward(F.linear(x, self.w13[expert])), self.w2[expert])

    def experts_forward(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert (`counts` [E] of each) through their experts."""
        if self.projections is None:
            return rows_by_expert([partial(self.expert_forward, expert)
                                   for expert in range(self.num_experts)],
                                  grouped, counts.tolist(), grouped.shape[1])
        gate_up, down = self.projections
        return down(self.act.forward(gate_up(grouped, counts)), counts)

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
        """(weights float32 [T, k], experts [T, k]), as transformers routes."""
        probs = torch.softmax(self.gate.forward(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.kernel_grouping:  # the rows gathered and summed back in C++
            grouped, counts, rows = group_by_expert(x, experts, self.num_experts)
            summed = combine_experts(self.experts_forward(grouped, counts), rows, weights)
        else:
            flat = experts.flatten()
            order = flat.argsort(stable=True)  # (token, expert) pairs grouped by expert
            tokens = order // self.top_k
            counts = torch.bincount(flat, minlength=self.num_experts)
            out = self.experts_forward(x.index_select(0, tokens), counts)
            out *= weights.to(x.dtype).flatten().index_select(0, order)[:, None]  # as HF rounds
            summed = torch.zeros_like(x).index_add_(0, tokens, out)
        return all_reduce(summed) if self.shard.size > 1 else summed
