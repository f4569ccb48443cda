"""w8a8: int8 weights (one scale per output channel) times int8 activations quantized per
token on the fly (x ≈ a·t, one scale t per row), multiplied in int32 (`torch._int_mm`) and
scaled back to float; on the CPU the quantizing and the scaling back are one C++ pass each
(engine/kernels/cpu/w8a8.cpp), bit-identical to the torch ops, and so is the product where a
C++ one replaces `_int_mm` (CPUs without int8 dot-product instructions)."""

from __future__ import annotations

import torch

from engine.kernels.w8a8 import gemm_serves as int8_gemm_serves
from engine.kernels.w8a8 import int8_matmul
from engine.kernels.w8a8 import kernels_serve as w8a8_kernels_serve
from engine.kernels.w8a8 import quantize_rows as w8a8_quantize_rows
from engine.kernels.w8a8 import rescale as w8a8_rescale
from engine.quantization.base import QuantizedLinear, per_channel_int8


class W8A8Linear(QuantizedLinear):
    method = "w8a8"
    weight_only = False
    keeps_dense_copy = False  # _int_mm serves every size

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.shape, bias)
        qweight, scale = per_channel_int8(weight)
        self.register_buffer("qweight_t", qweight.T)  # [K, N] view, as _int_mm takes it
        self.register_buffer("scale", scale)
        self.uses_kernels = w8a8_kernels_serve(weight.device, weight.dtype)
        self.uses_int8_gemm = self.uses_kernels and int8_gemm_serves()

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
        if self.uses_kernels:  # the same numbers as below, one C++ pass each side
            a, row_scale = w8a8_quantize_rows(x.contiguous())
            acc = (int8_matmul(a, self.qweight_t.T) if self.uses_int8_gemm
                   else torch._int_mm(a, self.qweight_t))
            return w8a8_rescale(acc, row_scale, self.scale, x.dtype)
        a, row_scale = self.quantize_input(x)
        if x.device.type == "cpu":
            acc = torch._int_mm(a, self.qweight_t).float()
        else:  # _int_mm's CUDA kernel wants M > 16; exact in float up to 2^24 per sum
            acc = a.float() @ self.qweight_t.float()
        return (acc * row_scale * self.scale).to(x.dtype)
