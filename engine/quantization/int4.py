"""int4: groups of `group_size` input channels with a scale and a zero each (W ≈ (q - 8)·s + z,
q in 0..15): the layout of a GGUF Q4_1 block, so a GGUF file's Q4_0, Q4_1 and Q4_K codes load
into it as they are (`from_codes`). Weight-only (`int4`), or with the activations quantized to
8 bits per group of 32 as they arrive (`w4a8`: llama.cpp's Q4 x Q8_1 product; the layer then
answers to float math on its dequantized weight and the fake-quantized activations)."""

from __future__ import annotations

import functools

import torch

from engine.kernels import moe_int4, w4a8
from engine.kernels.build import kernel_enabled
from engine.kernels.int4_matmul import kernel_serves, pack_nibbles, run_int4_matmul, unpack_nibbles
from engine.platform.cpu import cpu_flags
from engine.quantization.base import DEFAULT_GROUP_SIZE, QuantizedLinear

INT4_ZERO_POINT = 8  # torch's int4 kernels store a group's zero as its value at q = 8
# bf16 steps of up to this many tokens read the codes; larger ones the packed bf16 copy, as do
# steps with prompt rows (padded to 64: engine.layers.batch_invariant, so a prompt's rows are
# the copy's products whatever its step: keep this below that). Where the grouped kernel serves
# (AVX512-BF16; `LOOM_CPU_INT4_GROUPED=0` turns it off for these layers) it reads the codes
# once per 8 rows: the default model's 120 linears, each streamed from memory, on a Zen 4 VM
# (no AMX) 4.7 ms at 1 row, 6.0 at 8, 12.7 at 16, 23.1 at 32, 38.7 at 56 rows, the bf16 copy
# 16.5, 24.9 and 43.4 at 16, 32 and 56, and even at 64 (docs/benchmarks.md, "The grouped int4
# kernel up to 56 rows"). With AMX the copy's products run on tiles: unmeasured there, it keeps
# the 16 rows it had. Without the grouped kernel, torch's int4 kernel is slower than the copy
# above 4 rows (max_kernel_rows).
GROUPED_KERNEL_ROWS = 56
GROUPED_KERNEL_ROWS_AMX = 16


@functools.cache
def grouped_kernel_rows() -> int:
    """The most tokens of a bf16 step that the grouped kernel multiplies on this CPU."""
    return GROUPED_KERNEL_ROWS_AMX if "amx_bf16" in cpu_flags() else GROUPED_KERNEL_ROWS


class Int4Linear(QuantizedLinear):
    max_kernel_rows = 4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int = DEFAULT_GROUP_SIZE, int8_activations: bool = False) -> None:
        """Quantizes a float weight: each group's minimum and maximum span codes 0..15."""
        super().__init__(weight.shape, bias)
        self.weight_only = not int8_activations
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
                   bias: torch.Tensor | None, dtype: torch.dtype,
                   int8_activations: bool = False) -> Int4Linear:
        """A layer holding given codes as they are (a GGUF Q4_0 / Q4_1 tensor's):
        W = (q - 8)·scale + zero, q [N, K] in 0..15, scale and zero [N, groups]."""
        layer = cls.__new__(cls)
        QuantizedLinear.__init__(layer, q.shape, bias)
        layer.weight_only = not int8_activations
        layer._hold(q, scale, zero, dtype)
        return layer

    @property
    def method(self) -> str:
        return "int4" if self.weight_only else "w4a8"

    def _hold(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              dtype: torch.dtype) -> None:
        """On CPU only a kernel's packed form of q is kept (for bf16 the grouped kernel's where
        the CPU has AVX512-BF16, else torch's; ours for fp32: torch's is slow there); elsewhere
        q itself. Until `finish_loading`, q is at hand too: dense copies are made from it
        directly."""
        self.group_size = self.in_features // scale.shape[1]
        self._loading_codes: torch.Tensor | None = q.to(torch.uint8)
        # [K / group, N, 2], the layout torch's CPU kernel reads, in the activations' dtype.
        scales_and_zeros = torch.stack([scale.T, zero.T], dim=-1).contiguous().to(dtype)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        on_cpu = q.device.type == "cpu"
        serves = kernel_serves if self.weight_only else w4a8.kernel_serves
        ours = on_cpu and serves(q.device, dtype, self.group_size)
        grouped = (on_cpu and self.weight_only and kernel_enabled("LOOM_CPU_INT4_GROUPED")
                   and moe_int4.kernel_serves(dtype, self.group_size, self.out_features,
                                              self.in_features))
        blocks = moe_int4.pack_experts(q[None], scales_and_zeros[None]) if grouped else None
        self.register_buffer("grouped_blocks", blocks)
        self._grouped_args = (blocks,) if grouped else None
        if grouped:
            self.kernel_rows = grouped_kernel_rows()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), 1) if on_cpu and not ours and not grouped else None)
        self.register_buffer("nibbles", pack_nibbles(q) if ours else None)
        self.register_buffer("q", None if on_cpu else q.to(torch.uint8))
        # The kernels' arguments as plain attributes (no nn.Module __getattr__ per call).
        self._kernel_args = ((self.packed, self.group_size, self.scales_and_zeros)
                             if self.packed is not None else None)
        self._float_kernel_args = None
        if ours:  # W = q·s + o with o = z - 8·s, in fp32 [N, groups]
            scale, zero = scale.float().contiguous(), zero.float()
            offset = (zero - INT4_ZERO_POINT * scale).contiguous()
            self._float_kernel_args = (self.nibbles, scale, offset)
        self._float_kernel = run_int4_matmul if self.weight_only else w4a8.run_w4a8_matmul

    @property
    def serves_float32(self) -> bool:
        return self._float_kernel_args is not None

    def dequantized_weight(self) -> torch.Tensor:
        """(q - 8)·s + z in float32, with s and z as stored (rounded to the model's dtype)."""
        scales_and_zeros = self.scales_and_zeros.float()
        scale = scales_and_zeros[..., 0].T.unsqueeze(-1)  # [N, groups, 1]
        zero = scales_and_zeros[..., 1].T.unsqueeze(-1)
        codes = self.codes().float()
        grouped = codes.view(codes.shape[0], -1, self.group_size)
        return ((grouped - INT4_ZERO_POINT) * scale + zero).view(codes.shape)

    def codes(self) -> torch.Tensor:
        """q [N, K]. On CPU the kernel's own unpacking recovers it: the identity times the
        packed weight with every scale 1 and zero 8 gives q itself, exactly (bf16 holds
        0..15; the kernel's fp32 path is far slower)."""
        if self.nibbles is not None:
            return unpack_nibbles(self.nibbles)
        if self.grouped_blocks is not None:
            return moe_int4.unpack_experts(self.grouped_blocks)[0][0]
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

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.weight_only else w4a8.fake_quantize_groups(x).to(x.dtype)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self._float_kernel_args is not None:
            return self._float_kernel(x, *self._float_kernel_args)
        x = self.dense_input(x)
        if self._grouped_args is not None:  # the grouped kernel, with one "expert"
            return moe_int4.run_moe_int4(x, None, *self._grouped_args)
        if self._kernel_args is not None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, *self._kernel_args)
        return x @ self.dequantized_weight().to(x.dtype).T

