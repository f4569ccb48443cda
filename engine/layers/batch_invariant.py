"""Batch-invariant mode (`--batch-invariant`, or vLLM's `VLLM_BATCH_INVARIANT=1`): a row's
logits are the same bits whatever else shares its step, whether its prompt hit the prefix
cache, how the prompt was chunked, and after preemption and recompute.

What made a row's numerics depend on its step, measured on the CPU (docs/batch-invariance.md):
- oneDNN picks a GEMM's kernel, and with it the order of a row's sums, by the number of rows
  (fp32 products differ below 16 rows, packed bf16 ones below 33 for some shapes): here every
  product multiplies at least MIN_ROWS rows, zero rows added and dropped (`RowPadded`);
- a weight-only quantized layer multiplies a few rows with its kernel and more with its dense
  copy: here one of them at every size (the dense copy where it keeps one);
- attention computes long prompt chunks, short ones and decodes with different kernels: here
  every query row is a decode row of the C++ kernel (the attention plan's `rows_only`), whose
  sums over a row's context do not depend on the other rows.
Norms, RoPE, the activation, the embedding and the sampler compute each row alone already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.moe import FusedMoE, Router
from engine.quantization.base import QuantizedLinear
from engine.quantization.unquantized import PackedLinear

MIN_ROWS = 64

PRODUCTS = (nn.Linear, PackedLinear, QuantizedLinear, Router)


class RowPadded(nn.Module):
    """`product` multiplying at least MIN_ROWS rows: a step's few rows are padded with zeros,
    whose results are dropped."""

    def __init__(self, product: nn.Module) -> None:
        super().__init__()
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= MIN_ROWS:
            return self.product.forward(x)
        padded = x.new_zeros((MIN_ROWS, *x.shape[1:]))
        padded[:rows] = x
        return self.product.forward(padded)[:rows]


class TiedProduct(nn.Module):
    """x times a weight held elsewhere (an output projection tied to the embedding)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        object.__setattr__(self, "weight", weight)  # not a second parameter of the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def make_batch_invariant(model: nn.Module) -> int:
    """Every linear product of the model (projections, experts, the output head) padded to
    MIN_ROWS rows, weight-only layers on one path at every size; returns how many."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.dense is not None:
            module.kernel_rows = 0
        if isinstance(module, FusedMoE) and module.products is None:
            module.replace_products(lambda weight, bias: TiedProduct(weight))
    if getattr(model, "lm_head", ()) is None:
        model.lm_head = TiedProduct(model.model.embed_tokens.weight)
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, QuantizedLinear):  # its dense copy is inside the product
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, (*PRODUCTS, TiedProduct)):
                setattr(parent, name, RowPadded(child))
                wrapped += 1
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.rebind_products()
    return wrapped
