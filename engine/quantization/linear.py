"""Quantized linear layers, made from a model's float weights at load time (`--quantization`).

- int8: weight-only, one symmetric scale per output channel (W ≈ q·s, q in -127..127).
- int4: weight-only, groups of `group_size` input channels with a scale and a zero each
  (W ≈ (q - 8)·s + z, q in 0..15): the layout of a GGUF Q4_1 block.
- q8_0: a GGUF Q8_0 tensor's own codes, blocks of 32 with one scale each (W = q·d), read
  by a small C++ kernel in decode steps (engine.kernels.q8_0_matmul).
- w8a8: int8 weights as above times int8 activations quantized per token on the fly
  (x ≈ a·t, one scale t per row), multiplied in int32 (`torch._int_mm`), scaled back to float;
  on the CPU the quantizing and the scaling back are one C++ pass each
  (engine.kernels.w8a8), bit-identical to the torch ops.

Each layer answers to float math on its own dequantized weights (`dequantized_weight`; w8a8
also on its fake-quantized activations, `fake_quantized_input`).

Weight-only kernels win only on bf16 activations and only while a step is memory-bound. In
fp32 torch's int8/int4 kernels run 5-70x slower than `F.linear` (576x3072 at 1 and 64 rows:
743 / 47,919 and 1,533 / 96,421 µs against 159 / 1,419), so an fp32 weight-only layer keeps
its dequantized weight in fp32 and always multiplies that: correct, no faster, no smaller.
In bf16 on a 2-core AVX512-BF16 CPU the default model's decode step at 1 / 2 / 4 / 8 / 16
tokens spends 11.4 / 12.6 / 10.4 / 12.3 / 15.8 ms in bf16 GEMMs, 8.8 / 12.0 / 13.7 / 25.7 /
42.9 in int8 and 3.9 / 5.3 / 6.8 / 13.3 / 25.3 in int4 (`bench.profile_step
--quantization`). So where oneDNN packs bf16 natively, a
weight-only layer also keeps its dequantized weight as a packed bf16 copy and multiplies
steps above `max_kernel_rows` tokens with it: small decode batches read the small weights,
large batches and prefill run at the bf16 rate, and the copy costs memory (reported at load).
bf16 without native bf16 runs torch's packed CPU kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) at every size; off CPU each call multiplies the dequantized
weight, correct but slow (the GPU path is its own issue). w8a8 has no copy: `_int_mm` beats
fp32 `F.linear` (449 against 1,419 µs above at 64 rows) and roughly ties packed bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.q8_0_matmul import MAX_ROWS as Q8_MAX_ROWS
from engine.kernels.q8_0_matmul import Q8_BLOCK, run_q8_0_matmul
from engine.kernels.q8_0_matmul import kernel_applies as q8_kernel_applies
from engine.kernels.w8a8 import kernels_apply as w8a8_kernels_apply
from engine.kernels.w8a8 import quantize_rows as w8a8_quantize_rows
from engine.kernels.w8a8 import rescale as w8a8_rescale
from engine.layers.linear import PackedLinear, packing_applies
from engine.layers.opaque_linear import register_opaque_linear

QUANTIZATION_METHODS = ("none", "int8", "int4", "w8a8")
DEFAULT_GROUP_SIZE = 32
INT4_ZERO_POINT = 8  # torch's int4 kernels store a group's zero as its value at q = 8


class QuantizedLinear(nn.Module):
    """y = x Wᵀ + b for a weight held quantized; subclasses say how."""

    method = "none"
    weight_only = True  # activations stay float: a dense copy computes the same function
    max_kernel_rows = 0  # weight-only, bf16: steps of more tokens run on the dense copy

    def __init__(self, shape: torch.Size, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else bias.detach()
        self.dense: nn.Module | None = None
        self._dense_call: nn.Module | None = None
        self.kernel_rows = self.max_kernel_rows  # 0 once a dense copy takes every step
        self.handle = register_opaque_linear(self)

    def finish_loading(self) -> None:
        """Drops what only loading needed."""

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def dense_dtype(self) -> torch.dtype:
        """The model's dtype, which the layer's scales are held in."""
        return self.scale.dtype if hasattr(self, "scale") else self.scales_and_zeros.dtype

    def keep_dense_copy(self, dtype: torch.dtype) -> None:
        """A packed copy of the dequantized weight for steps above `max_kernel_rows` tokens."""
        self.dense = PackedLinear(self.dequantized_weight().to(dtype), self.bias)
        object.__setattr__(self, "_dense_call", self.dense)

    def keep_float_copy(self) -> None:
        """The dequantized weight in fp32, for every step (the kernels are slow in fp32)."""
        self.dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                               device=self.device)
        self.dense.weight.data = self.dequantized_weight().to(self.device)
        if self.bias is not None:
            self.dense.bias.data = self.bias.float()
        self.dense.requires_grad_(False)
        object.__setattr__(self, "_dense_call", self.dense)
        self.kernel_rows = 0

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (2-D) times the weight, transposed."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.loom.linear(x, self.handle)
        if x.dim() != 2:  # the engine's activations are [tokens, features] already
            return self.forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], -1)
        # `_dense_call` is `dense` held as a plain attribute: nn.Module's __getattr__ costs
        # ~1 µs a lookup, and a decode step makes hundreds of these calls.
        if x.shape[0] > self.kernel_rows and self._dense_call is not None:
            return self._dense_call(x)
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}"


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], s float32 [N]) with W ≈ q·s, symmetric per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Linear(QuantizedLinear):
    method = "int8"
    max_kernel_rows = 1

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.shape, bias)
        qweight, scale = per_channel_int8(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(weight.dtype))  # the kernel's dtype is x's
        self._kernel_args = (self.qweight, self.scale)  # plain: no __getattr__ per call

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x, *self._kernel_args)
        return x @ self.dequantized_weight().to(x.dtype).T


class Int4Linear(QuantizedLinear):
    method = "int4"
    max_kernel_rows = 4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int = DEFAULT_GROUP_SIZE) -> None:
        """Quantizes a float weight: each group's minimum and maximum span codes 0..15."""
        super().__init__(weight.shape, bias)
        if self.in_features % group_size:
            raise ValueError(f"int4: {self.in_features} input channels are not a multiple of "
                             f"the group size {group_size}")
        groups = weight.detach().float().reshape(self.out_features, -1, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        zero = low + INT4_ZERO_POINT * scale
        self._hold(q.reshape(self.out_features, -1), scale, zero, weight.dtype)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> Int4Linear:
        """A layer holding given codes as they are (a GGUF Q4_0 / Q4_1 tensor's):
        W = (q - 8)·scale + zero, q [N, K] in 0..15, scale and zero [N, groups]."""
        layer = cls.__new__(cls)
        QuantizedLinear.__init__(layer, q.shape, bias)
        layer._hold(q, scale, zero, dtype)
        return layer

    def _hold(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              dtype: torch.dtype) -> None:
        """On CPU only the kernel's packed form of q is kept; elsewhere q itself. Until
        `finish_loading`, q is at hand too: dense copies are made from it directly."""
        self.group_size = self.in_features // scale.shape[1]
        self._loading_codes: torch.Tensor | None = q.to(torch.uint8)
        # [K / group, N, 2], the layout the CPU kernel reads, in the activations' dtype.
        scales_and_zeros = torch.stack([scale.T, zero.T], dim=-1).contiguous().to(dtype)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        on_cpu = q.device.type == "cpu"
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), 1) if on_cpu else None)
        self.register_buffer("q", None if on_cpu else q.to(torch.uint8))
        # The kernel's arguments as a plain attribute (no nn.Module __getattr__ per call).
        self._kernel_args = ((self.packed, self.group_size, self.scales_and_zeros) if on_cpu
                             else None)

    def dequantized_weight(self) -> torch.Tensor:
        """(q - 8)·s + z in float32, with s and z as stored (rounded to the model's dtype)."""
        scales_and_zeros = self.scales_and_zeros.float()
        scale = scales_and_zeros[..., 0].T.repeat_interleave(self.group_size, 1)
        zero = scales_and_zeros[..., 1].T.repeat_interleave(self.group_size, 1)
        return (self.codes().float() - INT4_ZERO_POINT) * scale + zero

    def codes(self) -> torch.Tensor:
        """q [N, K]. On CPU the kernel's own unpacking recovers it: the identity times the
        packed weight with every scale 1 and zero 8 gives q itself, exactly (bf16 holds
        0..15; the kernel's fp32 path is ~50x slower)."""
        if self.packed is None:
            return self.q
        if self._loading_codes is not None:
            return self._loading_codes
        unit = torch.ones_like(self.scales_and_zeros, dtype=torch.bfloat16)
        unit[..., 1] = INT4_ZERO_POINT
        identity = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            identity, self.packed, self.group_size, unit).T.to(torch.uint8)

    def finish_loading(self) -> None:
        self._loading_codes = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_args is not None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, *self._kernel_args)
        return x @ self.dequantized_weight().to(x.dtype).T


class Q8_0Linear(QuantizedLinear):
    """A GGUF Q8_0 weight held as the file has it: int8 codes q [N, K] and one scale per block
    of 32 input channels, W = q·d. Up to `max_kernel_rows` tokens run the C++ kernel on the
    codes (engine.kernels.q8_0_matmul: half bf16's bytes, fp32 math); larger steps run the packed
    copy, or multiply the dequantized weight where no kernel builds."""

    method = "q8_0"
    max_kernel_rows = Q8_MAX_ROWS

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(codes.shape, bias)
        if self.in_features != scales.shape[1] * Q8_BLOCK or scales.shape[0] != codes.shape[0]:
            raise ValueError(f"Q8_0: {tuple(scales.shape)} scales for codes "
                             f"{tuple(codes.shape)} (blocks of {Q8_BLOCK})")
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("block_scales", scales.float().contiguous())
        self._dtype = dtype

    @property
    def dense_dtype(self) -> torch.dtype:
        return self._dtype

    def dequantized_weight(self) -> torch.Tensor:
        """q·d in float32, exactly as the file defines the weight."""
        blocks = self.codes.float().view(self.out_features, -1, Q8_BLOCK)
        return (blocks * self.block_scales[..., None]).view(self.out_features, -1)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if q8_kernel_applies(x):
            return run_q8_0_matmul(x, self.codes, self.block_scales)
        return (x.float() @ self.dequantized_weight().to(x.device).T).to(x.dtype)


class W8A8Linear(QuantizedLinear):
    method = "w8a8"
    weight_only = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.shape, bias)
        qweight, scale = per_channel_int8(weight)
        self.register_buffer("qweight_t", qweight.T)  # [K, N] view, as _int_mm takes it
        self.register_buffer("scale", scale)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight_t.T.float() * self.scale[:, None]

    @staticmethod
    def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a int8 [M, K], t float32 [M, 1]) with x ≈ a·t, symmetric per row."""
        x = x.float()
        scale = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(
            min=torch.finfo(torch.float32).tiny)
        return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale

    @classmethod
    def fake_quantized_input(cls, x: torch.Tensor) -> torch.Tensor:
        a, scale = cls.quantize_input(x.reshape(-1, x.shape[-1]))
        return (a.float() * scale).reshape(x.shape)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if w8a8_kernels_apply(x):  # the same numbers as below, one C++ pass each side
            a, row_scale = w8a8_quantize_rows(x)
            return w8a8_rescale(torch._int_mm(a, self.qweight_t), row_scale, self.scale, x.dtype)
        a, row_scale = self.quantize_input(x)
        if x.device.type == "cpu":
            acc = torch._int_mm(a, self.qweight_t).float()
        else:  # _int_mm's CUDA kernel wants M > 16; exact in float up to 2^24 per sum
            acc = a.float() @ self.qweight_t.float()
        return (acc * row_scale * self.scale).to(x.dtype)


def quantize_linears(model: nn.Module, method: str,
                     group_size: int = DEFAULT_GROUP_SIZE) -> list[QuantizedLinear]:
    """Replaces every `nn.Linear` of the model by a quantized one; a tied output projection
    (`lm_head is None`) gets a quantized copy of the embedding, the embedding staying for the
    lookup. Returns the new layers."""
    if method == "none":
        return []
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}: one of {QUANTIZATION_METHODS}")

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantizedLinear:
        if method == "int4":
            return Int4Linear(weight, bias, group_size)
        return Int8Linear(weight, bias) if method == "int8" else W8A8Linear(weight, bias)

    made = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                made.append(make(child.weight, child.bias))
                setattr(parent, name, made[-1])
    if getattr(model, "lm_head", ()) is None:
        made.append(make(model.model.embed_tokens.weight, None))
        model.lm_head = made[-1]
    attach_dense_copies(made)
    return made


def attach_dense_copies(layers: list[QuantizedLinear]) -> None:
    """The last step of loading quantized layers: weight-only ones get their packed bf16 copy
    where oneDNN packs bf16 natively, an fp32 one in an fp32 model (see the module's
    docstring); w8a8 ones none."""
    for layer in layers:
        dtype = layer.dense_dtype
        if layer.weight_only and dtype == torch.float32:
            layer.keep_float_copy()
        elif layer.weight_only and packing_applies(layer.device, dtype):
            layer.keep_dense_copy(dtype)
        layer.finish_loading()


def quantization_summary(model: nn.Module) -> str:
    """One phrase for the start-up log: what the linears hold and which kernel runs when."""
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    if not layers:
        return "linears not quantized"
    first = layers[0]
    text = f"{len(layers)} {first.method} linears"
    if isinstance(first, Int4Linear):
        text += f" (groups of {first.group_size})"
    if isinstance(first.dense, PackedLinear):
        text += (f"; steps above {first.kernel_rows} tokens on a packed "
                 f"{first.dense.packed_weight.dtype} copy")
    elif first.dense is not None:
        text += "; every step on an fp32 copy (the int kernels are slow in fp32)"
    return text
