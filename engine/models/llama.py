"""Llama-family decoder (Llama 1-3, SmolLM, Mistral, Qwen2): its structure, composed of layers.

The model sees one flattened variable-length batch per step: every scheduled token of every
request, with its absolute position. q/k/v are one merged projection and gate/up another
(their parts named for the loader); how each layer splits over tensor-parallel ranks, loads,
quantizes and computes is the layers' own business (engine.layers, engine.quantization).

Mistral checkpoints load through the same class; a layer with a sliding window attends to
its last `sliding_window` tokens (`ModelConfig.layer_windows`), though every layer keeps the
whole context's KV blocks for now.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.workspace import Workspace
from engine.layers.activation import gated_activation
from engine.layers.attention import PagedAttention
from engine.layers.batch_invariant import with_padded_rows
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary, RotaryTables
from engine.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos and signed sin of each token's position


class Attention(nn.Module):
    qkv_parts: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # as the checkpoint names them

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          bias=config.qkv_bias, dtype=dtype,
                                          parts=self.qkv_parts)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        group = config.num_attention_heads // config.num_key_value_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim,
                                        config.hidden_size, bias=config.o_bias, dtype=dtype,
                                        unit=group * config.head_dim)
        self.rotary = Rotary()
        self.attn = PagedAttention(config.attention_scale or self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        qk = self.rotary.forward(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache)
        return self.o_proj.forward(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    gate_up_parts: tuple[str, ...] = ("gate_proj", "up_proj")  # as the checkpoint names them

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, self.gate_up_parts,
            bias=config.mlp_bias, dtype=dtype)
        self.act = gated_activation(config.activation)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    """Submodules are called through `.forward`: nn.Module.__call__ (hooks, which the engine
    never sets) costs a little on every call, and a decode step makes hundreds of them."""

    attention_class: type[Attention] = Attention
    mlp_name = "mlp"  # the feed-forward block's name in the checkpoint

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self.attention_class(config, dtype)
        self.self_attn.attn.window = config.window_of(index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        feed_forward = self.make_feed_forward(config, dtype, index)
        setattr(self, self.mlp_name, feed_forward)
        object.__setattr__(self, "feed_forward", feed_forward)  # plain: no __getattr__ a call

    def make_feed_forward(self, config: ModelConfig, dtype: torch.dtype | None,
                          index: int) -> nn.Module:
        return MLP(config, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output; residual: the stream it adds to (None on the first
        layer, whose x is the embedding). Returns this layer's output and the stream."""
        if residual is None:
            residual, x = x, self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x, rope, kv_cache)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.feed_forward.forward(x), residual


class LlamaModel(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer
    norm_offset = 0.0  # the final norm's RMSNorm weight_offset (Gemma's scale by 1 + w)

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            self.layer_class(config, dtype, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, self.norm_offset)
        self.rotary_tables = RotaryTables(config.rope, config.head_dim,
                                          config.max_position_embeddings, dtype)


class LlamaForCausalLM(nn.Module):
    """Parameters follow HF names except the merged `qkv_proj` and `gate_up_proj`; a tied
    output projection (`lm_head is None`) multiplies by the embedding.

    Build under `torch.device("meta")` and fill through engine.weights.loader."""

    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, dtype)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(
            config.vocab_size, config.hidden_size, dtype)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this process holds: all of them, or its share under tensor parallelism."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def num_local_heads(self) -> int:
        return self.model.layers[0].self_attn.num_heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.num_local_kv_heads, block_size, self.config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """Hidden states [T, hidden] BEFORE the final norm; `compute_logits` applies it.

        Attention reads the step's metadata from `engine.attention.forward_context`."""
        rope = self.model.rotary_tables.forward(positions)
        x, residual = self.model.embed_tokens.forward(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, rope, kv_cache)
        return x + residual

    def output_projection(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def compute_logits(self, hidden: torch.Tensor, workspace: Workspace | None = None,
                       float32: bool = True) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows of `forward`'s output that get sampled; in
        a buffer of `workspace` when given (the runner's, reused every step: a fresh
        32 x 262k float32 tensor costs ~8 ms of page faults on the CPU). `float32=False`:
        the output projection's own (a greedy argmax needs no copy)."""
        hidden = self.model.norm(hidden)
        # The sampled rows, padded where the step asks (engine.layers.batch_invariant)
        logits = with_padded_rows(self.output_projection, hidden)
        if not float32:
            return logits
        if workspace is None:
            return logits.float()
        buffer = workspace.get("logits", logits.numel(), torch.float32, logits.device)
        return buffer.view(logits.shape).copy_(logits)
