"""Row counts that do not change a row's numerics: batch-invariant mode (`--batch-invariant`,
or vLLM's `VLLM_BATCH_INVARIANT=1`), and the default's promise that a prefix-cache hit does
not change an answer.

What made a row's numerics depend on its step, measured on the CPU (docs/batch-invariance.md):
- oneDNN picks a GEMM's kernel, and with it the order of a row's sums, by the number of rows
  (fp32 products differ below 16 rows, packed bf16 ones below 33 for some shapes);
- a weight-only quantized layer multiplies a few rows with its kernel and more with its dense
  copy;
- attention computes long prompt chunks, short ones and decodes with different kernels.
Norms, RoPE, the activation, the embedding and the sampler compute each row alone already.

So on the CPU, eager, a step whose forward context asks for it (`pad_products`: every step in
batch-invariant mode; by default the steps that compute prompt rows) runs at least
`min_rows` rows (64 in bf16, 16 in fp32): the model runner pads the step's tokens (attention
computes only the real ones), a routed expert pads the rows that reach it, the output head the
rows it samples. In the mode,
weight-only layers also multiply with their dense copy at every size, and every query row is a
decode row of the C++ attention kernel. Where every product of the model is a kernel of ours on
codes (fp32 with a GGUF's int4 / Q8_0 linears), which sums each output in one order whatever
shares the call, the mode pads nothing and those kernels take every step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from engine.attention.forward_context import pads_products
from engine.quantization.base import QuantizedLinear

MIN_ROWS = 64  # bf16: oneDNN's packed products keep their kernel from 33 rows
MIN_ROWS_FP32 = 16  # fp32 products keep theirs from 16 rows (AVX-512 machines), 4 (AVX2)


def min_rows(dtype: torch.dtype) -> int:
    """The rows a padded step's products multiply at least, in `dtype`."""
    return MIN_ROWS_FP32 if dtype == torch.float32 else MIN_ROWS


def with_padded_rows(multiply: Callable[[torch.Tensor], torch.Tensor],
                     x: torch.Tensor) -> torch.Tensor:
    """multiply(x), x padded with zero rows to min_rows where this step asks for it (see the
    module's docstring); the padding's rows are dropped from the result."""
    extra = min_rows(x.dtype) - x.shape[0]
    if extra <= 0 or not pads_products():
        return multiply(x)
    return multiply(torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]))[:x.shape[0]]


def use_dense_copies(model: nn.Module) -> int:
    """Weight-only quantized layers multiply with their dense copy at every row count (the
    batch-invariant mode's); returns how many."""
    layers = [module for module in model.modules()
              if isinstance(module, QuantizedLinear) and module.dense is not None]
    for layer in layers:
        layer.kernel_rows = 0
    return len(layers)


def use_code_kernels(model: nn.Module) -> None:
    """Quantized layers multiply with their code kernels at every row count (the mode's, where
    every product has one: engine.executor.kernel_choice.code_kernels_only)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.kernel_rows = sys.maxsize
