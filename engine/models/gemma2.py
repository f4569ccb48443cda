"""Gemma 2: Gemma 3's layer without q/k norms, one rotary for every layer, and soft caps on
the attention scores (`attn_logit_softcapping`) and on the final logits."""

from __future__ import annotations

from engine.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model
from engine.models.llama import Attention


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_class = Attention


class Gemma2Model(Gemma3Model):
    layer_class = Gemma2DecoderLayer  # type: ignore[assignment]


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    model_class = Gemma2Model  # type: ignore[assignment]
