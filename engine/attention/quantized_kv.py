"""An 8-bit KV cache (`--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2`): each cache row, one
token's one KV head, holds head_dim 8-bit codes followed by its fp32 scale (4 bytes, native
byte order), so a row is read whole from one place and a block moves as plain bytes (the
disk tier, tensor-parallel shares). The cache tensor's dtype says which codes it holds.

Rows are stored rotated: a key or value x is written as H x, H the normalized Hadamard matrix
(block-diagonal where head_dim is not a power of two). Keys have a few channels far larger
than the rest, and a row's scale follows its largest value; H spreads them over every
channel, halving the logit error of int8 codes on the default model. H is orthonormal and
symmetric, so attention over rotated keys and values with a rotated query gives the rotated
output: attention rotates q and its output (`rotate`), and nothing else changes.

Codes are symmetric: scale = the row's largest |x| / the code's largest value, code = x /
scale rounded to nearest even (int8: clamped to +-127; fp8: converted, saturating). An
all-zero row gets scale 1. The C++ write (engine/kernels/cpu/paged_decode.cpp) makes the same
bits for int8 rows."""

from __future__ import annotations

import functools

import torch

from common.config import KV_CACHE_DTYPES
from engine.platform.lifelong import lifelong

CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
               "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BYTES = 4


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", else the codes'."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in CODE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"not {kv_cache_dtype!r}")
    return CODE_DTYPES[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in CODE_MAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: head_dim, and the scale's bytes after 8-bit codes."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def describe(dtype: torch.dtype, head_dim: int, model_dtype: torch.dtype) -> str:
    """The cache's row format, and how many more tokens a byte holds than the model's dtype."""
    if not is_quantized(dtype):
        return str(dtype).removeprefix("torch.")
    plain = head_dim * torch.empty((), dtype=model_dtype).element_size()
    name, ratio = str(dtype).removeprefix("torch."), plain / (head_dim + SCALE_BYTES)
    return (f"{name} codes + fp32 scale per token and head, {ratio:.2f}x the tokens of "
            f"{str(model_dtype).removeprefix('torch.')}")


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [N, D] (any float dtype) -> [N, D + 4] cache rows of `dtype`."""
    values = x.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / CODE_MAX[dtype]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = values / scale
    if dtype == torch.int8:
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(dtype).view(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1).view(dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., D + 4] -> values [..., D] in `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.int8).view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


@functools.cache
def hadamard(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The normalized Hadamard matrix of the largest power of two dividing head_dim, repeated
    along the diagonal."""
    size = head_dim & -head_dim
    block = torch.ones(1, 1, dtype=torch.float64)
    while block.shape[0] < size:
        block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)])
    block /= size ** 0.5
    matrix = torch.block_diag(*[block] * (head_dim // size))
    return lifelong(matrix.to(device=device, dtype=dtype))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times H, in fp32 (its own inverse)."""
    matrix = hadamard(x.shape[-1], x.device, torch.float32)
    return (x.float() @ matrix).to(x.dtype)


def round_trip(x: torch.Tensor, cache: torch.dtype) -> torch.Tensor:
    """x [..., D] as a cache of `cache` dtype gives it back (x itself for a plain cache)."""
    if not is_quantized(cache):
        return x
    shape = x.shape
    return dequantize_rows(quantize_rows(x.reshape(-1, shape[-1]), cache), x.dtype).view(shape)
