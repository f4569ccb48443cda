"""Gemma 3 (text): Qwen3-like attention (q/k norms) with a pre- and a post-norm around both
the attention and the MLP, norms that scale by (1 + w), a GELU-tanh gated MLP, embeddings
scaled by sqrt(hidden), queries scaled by `query_pre_attn_scalar`, and sliding-window layers
with their own rotary base interleaved with global ones.

A sliding layer attends to its last `sliding_window` tokens; every layer keeps the whole
context's KV blocks (freeing the blocks behind a window is not done yet).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.workspace import Workspace
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryTables
from engine.models.config import ModelConfig
from engine.models.llama import MLP, Attention, KVCache, LlamaForCausalLM, LlamaModel, Rope
from engine.models.qwen3 import Qwen3Attention

GEMMA_NORM_OFFSET = 1.0


def gemma_norm(size: int, config: ModelConfig, dtype: torch.dtype | None) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype, weight_offset=GEMMA_NORM_OFFSET)


class Gemma3Attention(Qwen3Attention):
    qk_norm_offset = GEMMA_NORM_OFFSET


class Gemma3DecoderLayer(nn.Module):
    attention_class: type[Attention] = Gemma3Attention

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None, index: int) -> None:
        super().__init__()
        self.sliding = bool(config.layer_types) and \
            config.layer_types[index] == "sliding_attention"
        self.input_layernorm = gemma_norm(config.hidden_size, config, dtype)
        self.self_attn = self.attention_class(config, dtype)
        self.self_attn.attn.softcap = config.attn_logit_softcapping
        self.self_attn.attn.window = config.window_of(index)
        self.post_attention_layernorm = gemma_norm(config.hidden_size, config, dtype)
        self.pre_feedforward_layernorm = gemma_norm(config.hidden_size, config, dtype)
        self.mlp = MLP(config, dtype)
        self.post_feedforward_layernorm = gemma_norm(config.hidden_size, config, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layer: returns this layer's output, not yet added to the stream."""
        if residual is None:
            residual, x = x, self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.post_attention_layernorm.forward(self.self_attn.forward(x, rope, kv_cache))
        x, residual = self.pre_feedforward_layernorm.forward(x, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(x)), residual


class Gemma3Model(LlamaModel):
    layer_class = Gemma3DecoderLayer  # type: ignore[assignment]
    norm_offset = GEMMA_NORM_OFFSET

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__(config, dtype)
        rope_local = config.rope_local or config.rope
        self.rotary_tables_local = RotaryTables(rope_local, config.head_dim,
                                                config.max_position_embeddings, dtype)
        # sqrt(hidden) rounded to the model's dtype, as transformers scales the embeddings
        scale = torch.tensor(config.hidden_size**0.5, device="cpu",
                             dtype=dtype or torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model  # type: ignore[assignment]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache]) -> torch.Tensor:
        model = self.model
        ropes = (model.rotary_tables.forward(positions),
                 model.rotary_tables_local.forward(positions))
        x = model.embed_tokens.forward(input_ids)
        x, residual = x * model.embed_scale.to(x.dtype), None
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, ropes[layer.sliding], kv_cache)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor, workspace: Workspace | None = None,
                       float32: bool = True) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        logits = super().compute_logits(hidden, workspace, float32 or cap is not None)
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
