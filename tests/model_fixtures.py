"""Shared helpers for tests that need a model: tiny random checkpoints and attention metadata."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from engine.attention.forward_context import forward_context
from engine.attention.metadata import AttentionMetadata
from engine.attention.selector import select_attention_backend

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def randomize_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> None:
    """HF zero-inits biases and one-inits norms, which would hide mapping mistakes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise)


def build_tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides: Any):
    """A random transformers model (float32, eval mode) of the tiny shape above."""
    import transformers

    config_classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }
    config_class, model_class = config_classes[model_type]
    settings = {**TINY_LLAMA, **overrides}
    if settings.get("attn_logit_softcapping"):
        # SDPA has no soft cap, and transformers 5.17 builds Gemma 2 with it (5.25 refuses)
        settings["attn_implementation"] = "eager"
    torch.manual_seed(seed)
    model = model_class(config_class(**settings))
    randomize_weights(model, seed)
    return model.float().eval()


def build_tiny_llama_dir(tmp_path: Path | str, model_type: str = "llama", seed: int = 0,
                         **overrides: Any) -> str:
    """Write a tiny random checkpoint (config.json + model.safetensors, no tokenizer)."""
    model_dir = Path(tmp_path) / f"tiny-{model_type}"
    build_tiny_hf_model(model_type, seed, **overrides).save_pretrained(model_dir)
    return str(model_dir)


def build_metadata(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                   block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for one step: request i adds query_lens[i] tokens, ending at seq_lens[i]."""
    starts = [0]
    slots: list[int] = []
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens, strict=True):
        starts.append(starts[-1] + query_len)
        for position in range(seq_len - query_len, seq_len):
            slots.append(table[position // block_size] * block_size + position % block_size)
    width = max(len(table) for table in block_tables)
    padded = [table + [0] * (width - len(table)) for table in block_tables]
    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=list(seq_lens),
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )


def contiguous_metadata(query_lens: list[int], seq_lens: list[int], block_size: int,
                        blocks_per_seq: int, device: torch.device | str = "cpu",
                        ) -> AttentionMetadata:
    """Request i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq)."""
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
              for i in range(len(seq_lens))]
    return build_metadata(tables, seq_lens, query_lens, block_size, device)


def positions_for(seq_lens: list[int], query_lens: list[int],
                  device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.cat([torch.arange(s - q, s, device=device)
                      for s, q in zip(seq_lens, query_lens, strict=True)])


def allocate_kv_caches(model: Any, num_blocks: int, block_size: int,
                       dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Caches in the model's dtype unless told otherwise, as the engine allocates them."""
    dtype = dtype or model.model.embed_tokens.weight.dtype
    shape = model.kv_cache_shape(num_blocks, block_size)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(model.num_layers)]


def model_step(model: Any, metadata: AttentionMetadata, block_size: int,
               ) -> AbstractContextManager[None]:
    """The forward context of one step of `model` outside an engine: the attention backend
    the engine would choose for it, planning `metadata`."""
    weight = model.model.embed_tokens.weight
    backend = select_attention_backend(weight.device, weight.dtype, model.num_local_heads,
                                       model.num_local_kv_heads, model.config.head_dim,
                                       block_size)
    backend.plan(metadata)
    return forward_context(metadata, backend)
