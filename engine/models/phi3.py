"""Phi-3 (and Phi-4-mini's full-rotary siblings): Llama's structure with q/k/v and gate/up
stored fused in the checkpoint (`qkv_proj`, `gate_up_proj`), and LongRoPE scaling
(engine.layers.rotary)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel


class Phi3Attention(Attention):
    qkv_parts = ()


class Phi3MLP(MLP):
    gate_up_parts = ()


class Phi3DecoderLayer(DecoderLayer):
    attention_class = Phi3Attention

    def make_feed_forward(self, config: ModelConfig, dtype: torch.dtype | None,
                          index: int) -> nn.Module:
        return Phi3MLP(config, dtype)


class Phi3Model(LlamaModel):
    layer_class = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model
