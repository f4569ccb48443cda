"""Llama-family decoder (Llama 1-3, SmolLM, Mistral, Qwen2) for the paged engine.

The model sees one flattened variable-length batch per step: every scheduled token of
every request, with its absolute position; attention goes through the paged KV cache
behind `engine.attention.paged.paged_attention`.

Load-time layout (the loader maps Hugging Face names onto it):
  q/k/v projections are one `qkv_proj`, gate/up projections one `gate_up_proj`;
  rotary cos/sin are a table over all positions, indexed per token.

Mistral checkpoints load through the same class. Sliding-window attention is not
implemented: full attention equals it while a sequence fits in the window, so a model with
a window (Mistral v0.1: 4096; Mistral v0.2+ sets none) serves at most that many tokens
(`ModelConfig.max_exact_len`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.paged import attend
from engine.layers.elementwise import add_rms_norm, rms_norm, rotary, silu_and_mul

QKV_BIAS_MODEL_TYPES = frozenset({"qwen2"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3"})


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
        return cls(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
            factor=float(params.get("factor") or 1.0),
            original_max_position_embeddings=int(original_max) if original_max else None,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            **optional,
        )


@dataclass(slots=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    sliding_window: int | None = None  # the attention window transformers applies, if any

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        heads = config["num_attention_heads"]
        model_type = config.get("model_type", "llama")
        attention_bias = bool(config.get("attention_bias", False))
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config['hidden_act']!r}")
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type in QKV_BIAS_MODEL_TYPES,
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
            model_type=model_type,
            sliding_window=_sliding_window(config),
        )

    @property
    def max_exact_len(self) -> int:
        """The longest sequence this implementation computes as transformers does."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def max_rope_positions(self) -> int:
        """Positions the cos/sin table covers; dynamic NTK exists to run past the trained length."""
        if self.rope.rope_type == "dynamic":
            return int(self.max_position_embeddings * max(self.rope.factor, 1.0))
        return self.max_position_embeddings


def _sliding_window(config: dict[str, Any]) -> int | None:
    """Mistral applies `sliding_window` whenever it is set; Qwen2 only with use_sliding_window."""
    window = config.get("sliding_window")
    if not window or (config.get("model_type") == "qwen2" and not config.get("use_sliding_window")):
        return None
    return int(window)


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(item) for item in value)


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
    return inv_freq, 1.0


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


def rope_cos_sin(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_rope_positions, head_dim/2] in float32, on the CPU."""
    positions = torch.arange(config.max_rope_positions, dtype=torch.float32)
    if config.rope.rope_type == "dynamic":
        angles = positions[:, None] * _dynamic_ntk_inv_freq(config, positions)
        scale = 1.0
    else:
        inv_freq, scale = rope_inv_freq(config.rope, config.head_dim,
                                        config.max_position_embeddings)
        angles = torch.outer(positions, inv_freq)
    return angles.cos() * scale, angles.sin() * scale


def _dynamic_ntk_inv_freq(config: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """Per-position dynamic NTK frequencies [P, head_dim/2].

    transformers rescales the base from the longest sequence seen in the batch; with a KV
    cache that means a token at position p, decoded one at a time, uses seq_len = p + 1.
    Fixing that per position keeps a token's rotation independent of batching and chunking.
    """
    dim = config.head_dim
    trained = config.max_position_embeddings
    factor = config.rope.factor
    seq_len = torch.clamp(positions + 1, min=trained).double()
    base = config.rope.theta * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return (1.0 / base.float()[:, None] ** exponents).float()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual) (see fused_ops)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        qk = rotary(qk, cos, signed_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, kv_cache[0], kv_cache[1], self.scale)
        return self.o_proj.forward(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    """Submodules are called through `.forward`: nn.Module.__call__ (hooks, which the engine
    never sets) costs ~1.5 µs a call, and a decode step makes ~270 such calls."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                signed_sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output; residual: the stream it adds to (None on the first
        layer, whose x is the embedding). Returns this layer's output and the stream."""
        if residual is None:
            residual, x = x, self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x, cos, signed_sin, kv_cache)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Parameters follow HF names except the merged `qkv_proj` and `gate_up_proj`.

    Build under `torch.device("meta")` and fill with `load_state_dict(..., assign=True)`
    (see engine.weights.loader); the rotary tables are always computed on the CPU and follow
    `.to(device)`.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        cos, sin = rope_cos_sin_on_cpu(config)
        table_dtype = dtype or torch.get_default_dtype()
        self.register_buffer("rope_cos", torch.cat((cos, cos), -1).to(table_dtype),
                             persistent=False)
        self.register_buffer("rope_signed_sin", torch.cat((-sin, sin), -1).to(table_dtype),
                             persistent=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this process holds: all of them, or its share under tensor parallelism."""
        return self.model.layers[0].self_attn.num_kv_heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.num_local_kv_heads, block_size, self.config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] BEFORE the final norm; `compute_logits` applies it.

        Attention reads the step's metadata from `engine.attention.forward_context`."""
        cos = self.rope_cos[positions].unsqueeze(1)
        signed_sin = self.rope_signed_sin[positions].unsqueeze(1)
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, cos, signed_sin, kv_cache)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows of `forward`'s output that get sampled."""
        hidden = self.model.norm(hidden)
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


def rope_cos_sin_on_cpu(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.device("cpu"):
        return rope_cos_sin(config)
