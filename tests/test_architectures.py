"""Every served architecture, built tiny with random weights from a transformers config,
equals transformers' greedy `generate` token for token in fp32 through the engine: a mixed
batch with chunked prefill, preemption and prefix cache hits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kv_cache_groups import KVCacheLayout
from engine.models.config import ModelConfig
from engine.models.registry import ARCHITECTURES
from engine.weights.loader import load_model
from tests.engine_helpers import (
    assert_equals_transformers_generate,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.model_fixtures import build_tiny_hf_model
from tests.test_engine import prompt_of
from tests.test_model_parity import prefill_logits

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    # Experts of 32 columns, 2 of 4 per token; the second layer dense (mlp_only_layers).
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True,
                                "mlp_only_layers": [1]}),
    "qwen3_moe-unnormalized": ("qwen3_moe", {"head_dim": 16, "num_experts": 4,
                                             "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 32}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "intermediate_size": 32}),
    # LongRoPE; every request stays inside the original context of 100 tokens (past it,
    # transformers recomputes the whole context with the long factors; see test_model_parity).
    "phi3": ("phi3", {"original_max_position_embeddings": 100, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 0.5 * i for i in range(8)]}}),
    # Windows shorter than most requests (up to 90 tokens): each sliding layer attends to its
    # last W tokens, in decodes, chunked prefills and prefills on cached blocks.
    "mistral-window": ("mistral", {"sliding_window": 16}),
    "qwen2-window": ("qwen2", {"sliding_window": 20, "use_sliding_window": True,
                               "max_window_layers": 1, "num_hidden_layers": 3,
                               "tie_word_embeddings": True}),
    "gemma3_text-window": ("gemma3_text", {
        "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 24, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Soft caps on attention scores and logits low enough to bend them; alternating windows
    # of 24 tokens.
    "gemma2": ("gemma2", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 24,
                          "query_pre_attn_scalar": 16, "attn_logit_softcapping": 3.0,
                          "final_logit_softcapping": 5.0, "tie_word_embeddings": True}),
    # Two sliding layers (their own rotary base) around a global one with linear scaling;
    # every request fits in the 128-token window.
    "gemma3_text": ("gemma3_text", {
        "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 128, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 24,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1000.0},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}}}),
}


def test_every_served_architecture_has_a_case() -> None:
    assert {model_type for model_type, _ in CASES.values()} == set(ARCHITECTURES)


@pytest.mark.parametrize(("case", "compiled"), [
    *((case, False) for case in CASES), ("qwen3_moe", True), ("mixtral", True)])
def test_mixed_chunked_preempted_cached_batch_equals_transformers(case: str, compiled: bool,
                                                                   tmp_path: Path) -> None:
    model_type, overrides = CASES[case]
    hf_model = build_tiny_hf_model(model_type, **overrides)
    hf_model.save_pretrained(tmp_path / case)
    # 12 blocks of 16 tokens per KV cache group, 32 tokens a step: long prompts are chunked,
    # preemption certain.
    outputs, batch, _ = run_mixed_cached_preempted_batch(hf_model, tmp_path / case,
                                                         compile=compiled)
    assert_equals_transformers_generate(outputs, batch, hf_model)


def run_mixed_cached_preempted_batch(hf_model, model_dir: Path, **settings):
    """Greedy requests through an engine on `model_dir` (saved from `hf_model`): 12 blocks of
    16 tokens per KV cache group, 32 tokens a step, so long prompts are chunked and
    preemption is certain, and three prompts hit a cached prefix. (outputs, requests, the
    engine)."""
    layout = KVCacheLayout.for_model(ModelConfig.from_hf(hf_model.config.to_dict()))
    core = make_core(str(model_dir), num_kv_blocks=12 * layout.num_groups,
                     max_num_batched_tokens=32, **settings)
    shared = prompt_of(36, 99)  # two whole blocks that later prompts find in the cache
    first = greedy_request(shared + prompt_of(5, 1), max_tokens=4)
    run_to_completion(core, [first])
    prompts = [shared + prompt_of(n, i) for i, n in enumerate((5, 17, 30))]
    prompts += [prompt_of(n, 10 + i) for i, n in enumerate((3, 70, 1, 25))]
    batch = [greedy_request(prompt, max_tokens=20) for prompt in prompts]
    hits_before = core.block_manager.stats.hits
    outputs = run_to_completion(core, batch)
    assert core.block_manager.stats.hits - hits_before >= 3 * 32, "the shared prefix was hit"
    assert core.scheduler.num_preemptions >= 1
    assert any(0 < trace.scheduled.get(batch[4].request_id, 0) < 70 for trace in core.traces)
    return outputs, batch, core


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64}')
    with pytest.raises(ValueError) as refused:
        load_model(str(model_dir), torch.float32, torch.device("cpu"))
    message = str(refused.value)
    assert "'gpt2'" in message and "\n" not in message
    assert all(name in message for name in ARCHITECTURES)


def test_gemma2_logits_are_soft_capped_as_transformers_caps_them(tmp_path: Path) -> None:
    """Greedy tokens cannot see the final cap (tanh keeps the order): the logits can."""
    model_type, overrides = CASES["gemma2"]
    hf_model = build_tiny_hf_model(model_type, **overrides)
    hf_model.save_pretrained(tmp_path / "gemma2")
    ours = load_model(str(tmp_path / "gemma2"), torch.float32, torch.device("cpu"))
    prompt = prompt_of(30, 4)
    logits = prefill_logits(ours, prompt)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4
    assert logits.abs().max().item() <= overrides["final_logit_softcapping"]
