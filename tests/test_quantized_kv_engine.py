"""The engine with an 8-bit KV cache against transformers computing on the same codes: the
oracle's transformers model stores every key and value as the cache does (keys smoothed by
the engine's tables, rotated, quantized and back), so greedy outputs must agree token for
token through mixed batches, chunked prefill, preemption and prefix-cache hits, near ties
excused as elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager

from engine.attention.key_smoothing import KeySmoothing
from engine.attention.quantized_kv import dequantize_rows, quantize_rows, rotate
from engine.executor.model_runner import attention_layers
from tests.engine_helpers import assert_equals_transformers_generate
from tests.model_fixtures import build_tiny_hf_model
from tests.test_architectures import run_mixed_cached_preempted_batch
from tests.test_quantized_kv import CODES


def as_the_cache_holds(x: torch.Tensor, codes: torch.dtype) -> torch.Tensor:
    """Keys or values [..., D] as an 8-bit cache gives them back to attention."""
    rows = quantize_rows(rotate(x).reshape(-1, x.shape[-1]), codes)
    return rotate(dequantize_rows(rows, x.dtype)).view(x.shape)


def keys_as_the_cache_holds(key: torch.Tensor, codes: torch.dtype,
                            smoothing: KeySmoothing) -> torch.Tensor:
    """transformers' keys [B, kv_heads, T, D] as the cache gives them back, untransformed:
    what the engine's transformed query reads in them, less a shift that softmax ignores."""
    tokens_first = key.transpose(1, 2)
    rows = tokens_first.reshape(-1, *tokens_first.shape[2:])
    held = smoothing.keys_back(as_the_cache_holds(smoothing.keys(rows), codes))
    return held.view(tokens_first.shape).transpose(1, 2)


def key_tables(core) -> list[KeySmoothing]:
    tables = [layer.key_smoothing for layer in attention_layers(core.model)]
    assert all(table is not None for table in tables), "an 8-bit cache smooths every layer"
    return tables


def oracle_attention(codes: torch.dtype, tables: list[KeySmoothing],
                     inner=sdpa_attention_forward):
    """`inner` (transformers' own attention) over keys and values as the cache holds them,
    keys through the engine's `tables` (one per layer)."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        keys = keys_as_the_cache_holds(key, codes, tables[module.layer_idx])
        return inner(module, query, keys, as_the_cache_holds(value, codes), attention_mask,
                     **kwargs)
    return attention


@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_an_8bit_cache_equals_transformers_on_the_same_codes(model_type: str, codes: str,
                                                             tmp_path: Path) -> None:
    overrides = {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 24,
                 "attn_logit_softcapping": 3.0} if model_type == "gemma2" else {}
    hf_model = build_tiny_hf_model(model_type, **overrides)
    hf_model.save_pretrained(tmp_path / model_type)
    outputs, batch, core = run_mixed_cached_preempted_batch(hf_model, tmp_path / model_type,
                                                            kv_cache_dtype=codes)
    name = f"loom_{codes}_kv_{model_type}"
    inner = gemma2_eager if model_type == "gemma2" else sdpa_attention_forward  # SDPA: no caps
    AttentionInterface.register(name, oracle_attention(CODES[codes], key_tables(core), inner))
    AttentionMaskInterface.register(name, eager_mask if inner is gemma2_eager else sdpa_mask)
    hf_model.set_attn_implementation(name)
    assert_equals_transformers_generate(outputs, batch, hf_model)
