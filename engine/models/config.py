"""A decoder's shape as the engine reads it from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.layers.rotary import RopeConfig

QKV_BIAS_MODEL_TYPES = frozenset({"qwen2"})
OPTIONAL_WINDOW_MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen3_moe"})
SUPPORTED_ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh"})


@dataclass(slots=True)
class MoEConfig:
    """Routed experts: each token's `top_k` of `num_experts`, each expert an MLP of
    `intermediate_size`; the layers listed dense (or off the sparse step) keep one MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # the top-k weights rescaled to sum to 1
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> MoEConfig | None:
        model_type = config.get("model_type")
        if model_type == "mixtral":
            return cls(config["num_local_experts"], config["num_experts_per_tok"],
                       config["intermediate_size"], renormalize=True)
        if model_type == "qwen3_moe":  # transformers 5 writes num_experts under Mixtral's name
            experts = config.get("num_experts") or config["num_local_experts"]
            return cls(experts, config["num_experts_per_tok"],
                       config["moe_intermediate_size"],
                       renormalize=bool(config.get("norm_topk_prob", False)),
                       sparse_step=int(config.get("decoder_sparse_step") or 1),
                       dense_layers=tuple(config.get("mlp_only_layers") or ()))
        return None


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
    bos_token_id: int | None = None
    model_type: str = "llama"
    sliding_window: int | None = None  # the attention window transformers applies, if any
    layer_windows: tuple[int | None, ...] = ()  # per layer: its window, None for global ones
    moe: MoEConfig | None = None
    activation: str = "silu"  # of the gated MLP: silu or gelu_pytorch_tanh
    layer_types: tuple[str, ...] = ()  # per layer: full_attention or sliding_attention
    rope_local: RopeConfig | None = None  # the sliding layers' own rotary, where they have one
    attention_scale: float | None = None  # instead of head_dim ** -0.5
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        heads = config["num_attention_heads"]
        model_type = config.get("model_type", "llama")
        attention_bias = bool(config.get("attention_bias", False))
        activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}")
        query_scalar = config.get("query_pre_attn_scalar")
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
            rope=layer_rope(config, "full_attention"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type in QKV_BIAS_MODEL_TYPES,
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
            bos_token_id=bos if isinstance(bos := config.get("bos_token_id"), int) else None,
            model_type=model_type,
            sliding_window=_sliding_window(config),
            layer_windows=_layer_windows(config),
            moe=MoEConfig.from_hf(config),
            activation=activation,
            layer_types=tuple(config.get("layer_types") or ()),
            rope_local=layer_rope(config, "sliding_attention") if config.get("layer_types")
            else None,
            attention_scale=float(query_scalar) ** -0.5 if query_scalar else None,
            final_logit_softcapping=config.get("final_logit_softcapping"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
        )

    @property
    def max_exact_len(self) -> int:
        """The longest sequence this implementation computes as transformers does: the whole
        context (sliding-window layers attend through their window)."""
        return self.max_position_embeddings

    @property
    def windowed(self) -> bool:
        return any(window is not None for window in self.layer_windows)

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else None


def layer_rope(config: dict[str, Any], layer_type: str) -> RopeConfig:
    """The rotary of one kind of layer: transformers 5 keys `rope_parameters` by layer type
    where they differ (Gemma 3); earlier Gemma 3 configs give the sliding layers'
    base as `rope_local_base_freq`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return RopeConfig.from_hf({**config, "rope_scaling": None,
                                   "rope_parameters": params[layer_type]})
    if layer_type == "sliding_attention" and config.get("rope_local_base_freq"):
        return RopeConfig(theta=float(config["rope_local_base_freq"]))
    return RopeConfig.from_hf(config)


def _layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window: the layers `layer_types` calls sliding (Gemma 3, transformers 5's
    Qwens); without it, every layer (Mistral, Mixtral), or the Qwens' layers from
    `max_window_layers` on, as transformers 4 placed them."""
    window = _sliding_window(config)
    layers = int(config["num_hidden_layers"])
    if window is None:
        return (None,) * layers
    if config.get("layer_types"):
        return tuple(window if kind == "sliding_attention" else None
                     for kind in config["layer_types"])
    if config.get("model_type") in OPTIONAL_WINDOW_MODEL_TYPES:
        first = int(config.get("max_window_layers") or 0)
        return tuple(window if index >= first else None for index in range(layers))
    return (window,) * layers


def _sliding_window(config: dict[str, Any]) -> int | None:
    """Mistral and Mixtral apply `sliding_window` whenever it is set; the Qwens only with
    use_sliding_window."""
    window = config.get("sliding_window")
    if not window or (config.get("model_type") in OPTIONAL_WINDOW_MODEL_TYPES
                      and not config.get("use_sliding_window")):
        return None
    return int(window)


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(item) for item in value)
