"""A C++/OpenMP kernel for routed experts' 4-bit weights on CPUs with AVX512-BF16
(`kernels/cpu/moe_int4.cpp`): one call multiplies every expert's rows (grouped by expert) by
that expert's codes, bf16 in and out, products on `vdpbf16ps`. It replaces a Python loop of
small per-expert GEMMs and the packed bf16 copies they needed for larger batches: a step
reads each touched expert's half-byte codes once. Built once by `engine.kernels.build`; where
it cannot be built (or the CPU lacks AVX512-BF16) the experts stay per-expert layers.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.build import I64, INT, PTR, kernel_enabled, load_library

GROUP = 32  # input channels per scale and zero
TILE = 16  # output channels per tile: one vector of fp32 sums
CODE_BYTES = TILE * GROUP // 2  # a tile's codes of one group, before its scales and zeros


def kernel_serves(dtype: torch.dtype, group_size: int, n: int, k: int) -> bool:
    """bf16 activations, groups of 32, whole tiles, and a kernel built with AVX512-BF16."""
    return (dtype == torch.bfloat16 and group_size == GROUP and n % TILE == 0 and k % GROUP == 0
            and load_moe_int4_kernel() is not None)


def pack_experts(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's layout (see moe_int4.cpp) of q [E, n, k] in 0..15 and scales_and_zeros
    [E, k / 32, n, 2] (bf16, W = (q - 8)·s + z): blocks uint8 [E, n / 16, k / 32, 320], each
    a tile's 256 bytes of codes of one group, then its 16 scales and 16 zeros (bf16)."""
    experts, n, k = codes.shape
    groups, tiles = k // GROUP, n // TILE
    # k = 32·group + 4·chunk + 2·nibble + pair; a byte holds (channel, pair) of one chunk.
    q = codes.to(torch.uint8).reshape(experts, tiles, TILE, groups, 8, 2, 2)
    q = q.permute(0, 1, 3, 4, 2, 6, 5)  # expert, tile, group, chunk, channel, pair, nibble
    packed = (q[..., 0] | (q[..., 1] << 4)).reshape(experts, tiles, groups, CODE_BYTES)
    scales = scales_and_zeros.to(torch.bfloat16).reshape(experts, groups, tiles, TILE, 2)
    scales = scales.permute(0, 2, 1, 4, 3)  # expert, tile, group, s/z, channel
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(experts, tiles, groups, -1)
    return torch.cat([packed, scale_bytes], dim=-1).contiguous()


def unpack_experts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_experts`: (q [E, n, k] uint8, scales_and_zeros [E, k / 32, n, 2]
    bf16)."""
    experts, tiles, groups = blocks.shape[:3]
    codes = blocks[..., :CODE_BYTES]
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1)
    q = nibbles.reshape(experts, tiles, groups, 8, TILE, 2, 2).permute(0, 1, 4, 2, 3, 6, 5)
    q = q.reshape(experts, tiles * TILE, groups * GROUP)
    scales = blocks[..., CODE_BYTES:].contiguous().view(torch.bfloat16)
    scales = scales.reshape(experts, tiles, groups, 2, TILE)
    scales_and_zeros = scales.permute(0, 2, 1, 4, 3).reshape(experts, groups, tiles * TILE, 2)
    return q, scales_and_zeros


def run_moe_int4(x: torch.Tensor, counts: torch.Tensor | None, blocks: torch.Tensor,
                 ) -> torch.Tensor:
    """y [rows, n] bf16: x's rows (bf16 [rows, k]) grouped by expert, counts[e] of them
    (int64 [E]; None: one expert, all its rows) times expert e's weight transposed; blocks as
    `pack_experts` makes them."""
    library = load_moe_int4_kernel()
    assert library is not None
    x = x.contiguous()
    experts, tiles, groups = blocks.shape[:3]
    n, k = tiles * TILE, groups * GROUP
    counts_ok = experts == 1 if counts is None else (counts.dtype == torch.int64
                                                     and counts.shape == (experts,))
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not counts_ok:
        counts_text = "none" if counts is None else f"{tuple(counts.shape)} {counts.dtype}"
        raise ValueError(f"moe int4: x {tuple(x.shape)} {x.dtype}, counts {counts_text} "
                         f"against {experts} experts of {n} x {k}")
    y = x.new_empty((x.shape[0], n))
    status = library.loom_moe_int4(x.data_ptr(), x.shape[0],
                                   None if counts is None else counts.contiguous().data_ptr(),
                                   experts, blocks.data_ptr(), y.data_ptr(), n, k,
                                   torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the moe int4 kernel refused its arguments ({status})")
    return y


def group_by_expert(x: torch.Tensor, experts: torch.Tensor, num_experts: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing's (token, slot) pairs (experts int64 [T, k]) grouped by expert, tokens in
    order within one: (x's rows gathered so, bf16 [T * k, hidden]; counts int64 [E]; each
    pair's row there, int64 [T, k])."""
    library = load_moe_int4_kernel()
    assert library is not None
    x, experts = x.contiguous(), experts.contiguous()
    tokens, k = experts.shape
    grouped = x.new_empty((tokens * k, x.shape[1]))
    counts = experts.new_empty(num_experts)
    rows = torch.empty_like(experts)
    if library.loom_moe_group(experts.data_ptr(), tokens, k, num_experts, x.data_ptr(),
                              x.shape[1], counts.data_ptr(), rows.data_ptr(),
                              grouped.data_ptr()) != 0:
        raise ValueError(f"an expert outside 0..{num_experts - 1}")
    return grouped, counts, rows


def combine_experts(out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                    ) -> torch.Tensor:
    """y [T, hidden] bf16: each token's pairs' rows of out (bf16, `group_by_expert`'s order)
    times their weights (float32 [T, k]), summed in fp32 in the experts' order."""
    library = load_moe_int4_kernel()
    assert library is not None
    out, weights = out.contiguous(), weights.float().contiguous()
    tokens, k = rows.shape
    y = out.new_empty((tokens, out.shape[1]))
    library.loom_moe_combine(out.data_ptr(), rows.data_ptr(), weights.data_ptr(), tokens, k,
                             out.shape[1], y.data_ptr(), torch.get_num_threads())
    return y


@functools.cache
def load_moe_int4_kernel() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernels; None where they cannot be built,
    were built without AVX512-BF16, or LOOM_CPU_MOE_KERNEL=0."""
    if not kernel_enabled("LOOM_CPU_MOE_KERNEL"):
        return None
    library = load_library("moe_int4", "per-expert layers", {
        "loom_moe_int4_available": ([], ctypes.c_int),
        "loom_moe_int4": ([PTR, I64, PTR, I64, PTR, PTR, I64, I64, INT], ctypes.c_int),
        "loom_moe_group": ([PTR, I64, I64, I64, PTR, I64, PTR, PTR, PTR], ctypes.c_int),
        "loom_moe_combine": ([PTR, PTR, PTR, I64, I64, I64, PTR, INT], None)})
    if library is None or not library.loom_moe_int4_available():
        return None
    return library
