"""Qwen3 (dense): Llama's structure with an RMSNorm over each query and key head before the
rotation (`q_norm`, `k_norm`), and no qkv bias."""

from __future__ import annotations

import torch

from engine.layers.norm import RMSNorm
from engine.models.config import ModelConfig
from engine.models.llama import Attention, DecoderLayer, KVCache, LlamaForCausalLM, LlamaModel, Rope


class Qwen3Attention(Attention):
    qk_norm_offset = 0.0  # RMSNorm's weight_offset (Gemma's norms scale by 1 + w)

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__(config, dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, self.qk_norm_offset)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, self.qk_norm_offset)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads,
                                                                   self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        q = self.rotary.forward(self.q_norm.forward(q), *rope)
        k = self.rotary.forward(self.k_norm.forward(k), *rope)
        out = self.attn.forward(q, k, v, kv_cache)
        return self.o_proj.forward(out.reshape(tokens, self.q_size))


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
