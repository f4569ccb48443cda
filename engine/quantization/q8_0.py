"""GGUF Q8_0 codes held as the file has them, or in tiles of 16 channels for the tiled
kernel (bf16 on CPUs that multiply bf16 pairs)."""

from __future__ import annotations

import torch

from engine.kernels.q8_0_matmul import (
    BLOCKS,
    kernel_serves,
    run_q8_0_matmul,
    run_q8_0_tiles,
    tiled,
    tiles_serve,
    untiled,
)
from engine.quantization.base import QuantizedLinear


class Q8_0Linear(QuantizedLinear):
    """A GGUF Q8_0 weight held as the file has it: int8 codes q [N, K] and one scale per block
    of 32 input channels, W = q·d (Q5_0 and Q6_K tensors load into it exactly too, Q6_K with
    a scale per 16 input channels). Up to `max_kernel_rows` tokens in bf16, `FLOAT32_KERNEL_ROWS`
    in fp32, run the C++ kernel on the codes (engine.kernels.q8_0_matmul: fp32 math); larger
    steps run the packed or fp32 copy; where no kernel builds, every step multiplies the
    dequantized weight. Where the tiled kernel serves (bf16 activations, AVX512-BF16), the
    codes are held in its tiles and steps of up to `tiled_kernel_rows` tokens run it: it
    widens each code once for all of a step's rows (a speculative step verifies up to 9 at
    one stream)."""

    method = "q8_0"
    max_kernel_rows = 4
    tiled_kernel_rows = 12

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(codes.shape, bias)
        self.block = self.in_features // max(1, scales.shape[1])
        if (self.block not in BLOCKS or self.in_features != scales.shape[1] * self.block
                or scales.shape[0] != codes.shape[0]):
            raise ValueError(f"Q8_0: {tuple(scales.shape)} scales for codes "
                             f"{tuple(codes.shape)} (blocks of {' or '.join(map(str, BLOCKS))})")
        codes, scales = codes.to(torch.int8).contiguous(), scales.float().contiguous()
        self.tiled = tiles_serve(codes.device, dtype)
        if self.tiled:
            codes, scales = tiled(codes, scales)
            self.kernel_rows = self.tiled_kernel_rows
        self.register_buffer("codes", codes)
        self.register_buffer("block_scales", scales)
        self._dtype = dtype
        self.uses_kernel = kernel_serves(codes.device, dtype)

    @property
    def dense_dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def serves_float32(self) -> bool:
        """The tiled kernel takes bf16 only (so it never sums a batch-invariant fp32 step)."""
        return self.uses_kernel and not self.tiled

    def dequantized_weight(self) -> torch.Tensor:
        """q·d in float32, exactly as the file defines the weight."""
        codes, scales = self.codes, self.block_scales
        if self.tiled:
            codes, scales = untiled(codes, scales, self.out_features)
        blocks = codes.float().view(self.out_features, -1, self.block)
        return (blocks * scales[..., None]).view(self.out_features, -1)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled and x.dtype is torch.bfloat16:
            return run_q8_0_tiles(x, self.codes, self.block_scales, self.out_features)
        if self.uses_kernel and not self.tiled:
            return run_q8_0_matmul(x, self.codes, self.block_scales)
        return (x.float() @ self.dequantized_weight().to(x.device).T).to(x.dtype)
