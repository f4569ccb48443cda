"""`--quantization`: each method's layer, made from a model's float weights at load time.

A method is one file of this package: none (engine.quantization.unquantized), int8, int4 (and
w4a8: its weights with 8-bit activations), w8a8; the GGUF codes a file brings (Q4_0/Q4_1/Q4_K
as int4, Q8_0) load through engine.weights.gguf. A new method is a `QuantizedLinear` subclass
and one entry here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from engine.quantization.base import DEFAULT_GROUP_SIZE, QuantizedLinear
from engine.quantization.int4 import Int4Linear
from engine.quantization.int8 import Int8Linear
from engine.quantization.replace import replace_linears
from engine.quantization.unquantized import PackedLinear, packing_applies
from engine.quantization.w8a8 import W8A8Linear

Maker = Callable[[torch.Tensor, torch.Tensor | None, int], QuantizedLinear]
METHODS: dict[str, Maker] = {
    "int8": lambda weight, bias, group_size: Int8Linear(weight, bias),
    "int4": lambda weight, bias, group_size: Int4Linear(weight, bias, group_size),
    "w8a8": lambda weight, bias, group_size: W8A8Linear(weight, bias),
    "w4a8": lambda weight, bias, group_size: Int4Linear(weight, bias, group_size,
                                                        int8_activations=True),
}
QUANTIZATION_METHODS = ("none", *METHODS)


def quantize_linears(model: nn.Module, method: str,
                     group_size: int = DEFAULT_GROUP_SIZE) -> list[QuantizedLinear]:
    """Replaces every float linear of the model by one of `method` (see replace_linears);
    returns the new layers."""
    if method == "none":
        return []
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}: one of {QUANTIZATION_METHODS}")
    make = METHODS[method]
    made = replace_linears(model, lambda weight, bias: make(weight, bias, group_size))
    attach_dense_copies(made)
    return made


def attach_dense_copies(layers: list[QuantizedLinear]) -> None:
    """The last step of loading quantized layers: each gets its packed bf16 copy where oneDNN
    packs bf16 natively, an fp32 one in an fp32 model (engine.quantization.base); w8a8 ones
    and those that keep no dense copy (routed experts) none."""
    for layer in layers:
        dtype = layer.dense_dtype
        if layer.keeps_dense_copy:
            if dtype == torch.float32:
                layer.keep_float_copy()
            elif packing_applies(layer.device, dtype):
                layer.keep_dense_copy(dtype)
        layer.finish_loading()


def quantization_summary(model: nn.Module) -> str:
    """One phrase for the start-up log: what the linears hold and which kernel runs when."""
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    if not layers:
        return "linears not quantized"
    first = layers[0]
    counts = Counter(layer.method for layer in layers)
    text = " + ".join(f"{count} {method}" for method, count in counts.most_common()) + " linears"
    if isinstance(first, Int4Linear):
        text += f" (groups of {first.group_size}"
        text += ", the grouped AVX512-BF16 kernel)" if first.grouped_blocks is not None else ")"
    if isinstance(first.dense, PackedLinear):
        text += (f"; steps above {first.kernel_rows} tokens on a packed "
                 f"{first.dense.packed_weight.dtype} copy")
    elif first.dense is not None and first.kernel_rows:
        text += f"; steps above {first.kernel_rows} tokens on an fp32 copy"
    elif first.dense is not None:
        text += "; every step on an fp32 copy (the int kernels are slow in fp32)"
    return text
