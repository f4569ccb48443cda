"""What every quantized linear layer is: a weight held quantized, multiplied by its method's
kernel, answering to float math on its own dequantized weight (`dequantized_weight`).

Weight-only kernels win only while a step is memory-bound (docs/benchmarks.md has the figures).
In fp32 torch's int8/int4 kernels are many times slower than `F.linear`, so an fp32 weight-only
layer keeps its dequantized weight in fp32 and multiplies that, except for steps of up to
`FLOAT32_KERNEL_ROWS` tokens where a kernel of ours reads the codes with fp32 math (int4 in
groups of 32 and Q8_0: a GGUF's codes, `serves_float32`). Where oneDNN packs bf16 natively, a
weight-only layer also keeps its dequantized weight as a packed bf16 copy and multiplies steps
above `max_kernel_rows` tokens with it: small decode batches read the small weights, large
batches and prefill run at the bf16 rate, and the copy costs memory (reported at load). bf16
without native bf16 runs torch's packed CPU kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) at every size; off CPU each call multiplies the dequantized
weight, correct but slow. w8a8 keeps no copy: its activations are quantized too.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.unquantized import PackedLinear

DEFAULT_GROUP_SIZE = 32
# fp32 steps of up to this many tokens read the codes (kernels of ours); larger ones the fp32
# copy. One below the 16 rows a step with prompt rows multiplies (MIN_ROWS_FP32 in
# engine.layers.batch_invariant), so a prompt's rows always take the copy. AVX2-only EPYC,
# the default model's 120 int4 linears: 8 rows 41 vs 107 ms, 16 rows 76 vs 142, 64 rows 357
# vs 232.
FLOAT32_KERNEL_ROWS = 15


class QuantizedLinear(nn.Module):
    """y = x Wᵀ + b for a weight held quantized; subclasses say how."""

    method = "none"
    weight_only = True  # activations stay float (else `dense_input` quantizes them)
    max_kernel_rows = 0  # weight-only, bf16: steps of more tokens run on the dense copy
    keeps_dense_copy = True  # False: the codes' kernel takes every step (routed experts)

    def __init__(self, shape: torch.Size, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else bias.detach()
        self.dense: nn.Module | None = None
        self._dense_call: nn.Module | None = None
        self.kernel_rows = self.max_kernel_rows  # 0 once a dense copy takes every step

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

    @property
    def serves_float32(self) -> bool:
        """Whether a kernel of ours multiplies the codes with fp32 activations (Q8_0, int4)."""
        return False

    def keep_float_copy(self) -> None:
        """The dequantized weight in fp32: for steps above `FLOAT32_KERNEL_ROWS` tokens where a
        kernel serves fp32 (`serves_float32`), else for every step (torch's are slow in fp32)."""
        self.dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                               device="meta")  # no random init to overwrite
        self.dense.weight = nn.Parameter(self.dequantized_weight().to(self.device),
                                         requires_grad=False)
        if self.bias is not None:
            self.dense.bias = nn.Parameter(self.bias.float(), requires_grad=False)
        object.__setattr__(self, "_dense_call", self.dense)
        self.kernel_rows = FLOAT32_KERNEL_ROWS if self.serves_float32 else 0

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the dense copy must multiply it to compute the layer's function (activations
        quantized on the fly: fake-quantized)."""
        return x

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (2-D) times the weight, transposed."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the engine's activations are [tokens, features] already
            return self.forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], -1)
        # `_dense_call` is `dense` held as a plain attribute: nn.Module's __getattr__ costs
        # on every lookup, and a decode step makes hundreds of these calls.
        if x.shape[0] > self.kernel_rows and self._dense_call is not None:
            return self._dense_call(self.dense_input(x))
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}"


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], s float32 [N]) with W ≈ q·s, symmetric per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
