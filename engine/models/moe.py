"""Mixture-of-experts decoders: Qwen3-MoE (Qwen3's attention, routed experts in most layers)
and Mixtral (Mistral's attention, routed experts under `block_sparse_moe`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe import FusedMoE
from engine.models.config import ModelConfig
from engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM, LlamaModel
from engine.models.qwen3 import Qwen3DecoderLayer


def routed_experts(config: ModelConfig, dtype: torch.dtype | None,
                   expert_parts: tuple[str, str, str]) -> FusedMoE:
    moe = config.moe
    assert moe is not None
    return FusedMoE(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                    moe.renormalize, expert_parts, dtype)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_feed_forward(self, config: ModelConfig, dtype: torch.dtype | None,
                          index: int) -> nn.Module:
        assert config.moe is not None
        if not config.moe.is_sparse(index):
            return MLP(config, dtype)
        return routed_experts(config, dtype, ("gate_proj", "up_proj", "down_proj"))


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen3MoeModel


class MixtralDecoderLayer(DecoderLayer):
    mlp_name = "block_sparse_moe"

    def make_feed_forward(self, config: ModelConfig, dtype: torch.dtype | None,
                          index: int) -> nn.Module:
        return routed_experts(config, dtype, ("w1", "w3", "w2"))


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_class = MixtralModel
