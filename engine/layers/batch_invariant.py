"""Row counts that do not change a row's numerics: batch-invariant mode (`--batch-invariant`,
or vLLM's `VLLM_BATCH_INVARIANT=1`), and the default's promise that a prefix-cache hit does
not change an answer.

What made a row's numerics depend on its step, measured on the CPU (docs/batch-invariance.md):
- oneDNN picks a GEMM's kernel, and with it the order of a row's sums, by the number of rows
  (fp32 products differ below 16 rows, packed bf16 ones below 33 for some shapes): a padded
  product (`RowPadded`) multiplies at least MIN_ROWS rows, zero rows added and dropped;
- a weight-only quantized layer multiplies a few rows with its kernel and more with its dense
  copy;
- attention computes long prompt chunks, short ones and decodes with different kernels.
Norms, RoPE, the activation, the embedding and the sampler compute each row alone already.

On the CPU, eager, every linear product of the model (projections, experts and their router,
the output head) is padded: in batch-invariant mode at every step, with weight-only layers on
their dense copy at every size and every query row a decode row of the C++ attention kernel;
by default in steps that compute prompt rows, so that a prompt's rows come out the same
whether its first blocks were cached or computed with it (decode steps, the most frequent,
keep their few rows and their kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.forward_context import pads_products
from engine.layers.moe import FusedMoE, Router
from engine.quantization.base import QuantizedLinear
from engine.quantization.unquantized import PackedLinear

MIN_ROWS = 64


class TiedProduct(nn.Module):
    """x times a weight held elsewhere (an output projection tied to the embedding, an
    expert's slice of a stacked weight)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        object.__setattr__(self, "weight", weight)  # not a second parameter of the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


PRODUCTS = (nn.Linear, PackedLinear, QuantizedLinear, Router, TiedProduct)


class RowPadded(nn.Module):
    """`product` multiplying at least MIN_ROWS rows, always or in the steps whose forward
    context asks for it: a step's few rows are padded with zeros, whose results are dropped."""

    def __init__(self, product: nn.Module, always: bool) -> None:
        super().__init__()
        self.product = product
        self.always = always

    def __getattr__(self, name: str) -> object:
        """Whatever the product has (its weight, `dequantized_weight`, ...): the wrapper stands
        in its place for every reader, not only for the forward."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["product"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= MIN_ROWS or not (self.always or pads_products()):
            return self.product.forward(x)
        padded = x.new_zeros((MIN_ROWS, *x.shape[1:]))
        padded[:rows] = x
        return self.product.forward(padded)[:rows]


def pad_products(model: nn.Module, always: bool) -> int:
    """Every linear product of the model padded (`always`: at every step, and weight-only
    layers on their dense copy at every size); returns how many."""
    for module in model.modules():
        if always and isinstance(module, QuantizedLinear) and module.dense is not None:
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
            if isinstance(child, PRODUCTS):
                setattr(parent, name, RowPadded(child, always))
                wrapped += 1
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.rebind_products()
    return wrapped
