"""Rotary position embeddings: the frequencies of every rope type transformers implements
(default, linear, dynamic NTK, YaRN, Llama 3), their cos/sin tables over all positions, and
the half-split (GPT-NeoX / HF) rotation applied per token: one C++ pass on the CPU
(engine/kernels/cpu/elementwise.cpp), torch ops elsewhere."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.kernels.elementwise import load_elementwise, rows_of_contiguous_heads, run_rotary
from engine.layers.custom_op import CustomOp

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3", "longrope"})


@dataclass(slots=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the
    long_factor: tuple[float, ...] = ()  # original context, and beyond it

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeConfig:
        """Merge legacy `rope_theta`/`rope_scaling` keys with transformers 5 `rope_parameters`."""
        params: dict[str, Any] = {}
        for key in ("rope_scaling", "rope_parameters"):
            if isinstance(config.get(key), dict):
                params.update(config[key])
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        original_max = params.get("original_max_position_embeddings",
                                  config.get("original_max_position_embeddings"))
        optional = {key: params[key] for key in (
            "low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim",
            "truncate") if params.get(key) is not None}
        factor = params.get("factor")
        if rope_type == "longrope" and factor is None and original_max:
            factor = config.get("max_position_embeddings", 2048) / original_max  # Phi-3's way
        return cls(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
            factor=float(factor or 1.0),
            short_factor=tuple(params.get("short_factor") or ()),
            long_factor=tuple(params.get("long_factor") or ()),
            original_max_position_embeddings=int(original_max) if original_max else None,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            **optional,
        )


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / rope.theta**exponents
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope, max_position_embeddings), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, max_position_embeddings)
    if rope.rope_type == "longrope":  # the short factors: positions within the original context
        return inv_freq / torch.tensor(rope.short_factor), _longrope_scale(rope)
    return inv_freq, 1.0


def _longrope_scale(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0 or not rope.original_max_position_embeddings:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig,
                     max_position_embeddings: int) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings or max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int,
                   max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original_max = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original_max / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_positions(rope: RopeConfig, max_position_embeddings: int) -> int:
    """Positions the cos/sin table covers; dynamic NTK exists to run past the trained length."""
    if rope.rope_type == "dynamic":
        return int(max_position_embeddings * max(rope.factor, 1.0))
    return max_position_embeddings


def rope_cos_sin(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [positions, head_dim/2] in float32, on the CPU."""
    with torch.device("cpu"):
        positions = torch.arange(rope_positions(rope, max_position_embeddings),
                                 dtype=torch.float32)
        if rope.rope_type == "dynamic":
            inv_freq = _dynamic_ntk_inv_freq(rope, head_dim, max_position_embeddings, positions)
            angles, scale = positions[:, None] * inv_freq, 1.0
        elif rope.rope_type == "longrope":
            angles, scale = _longrope_angles(rope, head_dim, positions), _longrope_scale(rope)
        else:
            inv_freq, scale = rope_inv_freq(rope, head_dim, max_position_embeddings)
            angles = torch.outer(positions, inv_freq)
        return angles.cos() * scale, angles.sin() * scale


def _longrope_angles(rope: RopeConfig, head_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Position p rotates by the long factors once p + 1 exceeds the original context.
    transformers instead rotates a whole sequence by one set: the long factors once it is
    longer than the original context, recomputing the cache when a generation crosses it.
    Per position, a token's rotation never depends on its batch or chunk, and a sequence
    inside the original context (the short factors) is computed exactly as transformers does;
    one that crosses it differs from transformers from there on (a README limit)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = rope.theta**exponents
    short = 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32) * base)
    beyond = (positions + 1 > (rope.original_max_position_embeddings or 0))[:, None]
    return positions[:, None] * torch.where(beyond, long, short)


def _dynamic_ntk_inv_freq(rope: RopeConfig, dim: int, trained: int,
                          positions: torch.Tensor) -> torch.Tensor:
    """Per-position dynamic NTK frequencies [P, head_dim/2].

    transformers rescales the base from the longest sequence seen in the batch; with a KV
    cache that means a token at position p, decoded one at a time, uses seq_len = p + 1.
    Fixing that per position keeps a token's rotation independent of batching and chunking.
    """
    factor = rope.factor
    seq_len = torch.clamp(positions + 1, min=trained).double()
    base = rope.theta * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return (1.0 / base.float()[:, None] ** exponents).float()


class RotaryTables(nn.Module):
    """Tables [positions, head_dim] of cos and of sin with rotate_half's sign folded in, made
    on the CPU in float32 and held in the model's dtype (they follow `.to(device)`); looked up
    once per step for every layer."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        cos, sin = rope_cos_sin(rope, head_dim, max_position_embeddings)
        table_dtype = dtype or torch.get_default_dtype()
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(table_dtype), persistent=False)
        self.register_buffer("signed_sin", torch.cat((-sin, sin), -1).to(table_dtype),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, head_dim] of each token's position."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


class Rotary(CustomOp):
    """x [T, heads, D] rotated by its tokens' cos and signed sin (`RotaryTables`)."""

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                       ) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)

    def forward_cpu(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                    ) -> torch.Tensor:
        """x rotated in place (its heads may be a slice of a wider row, such as the q and k
        parts of a fused qkv output)."""
        if x.dtype != cos.dtype or not rows_of_contiguous_heads(x):
            return self.forward_native(x, cos, signed_sin)
        run_rotary(load_elementwise(), x, cos, signed_sin)
        return x
