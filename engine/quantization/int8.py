"""int8 weight-only: one symmetric scale per output channel (W ≈ q·s, q in -127..127)."""

from __future__ import annotations

import torch

from engine.quantization.base import QuantizedLinear, per_channel_int8


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
