"""GGUF files of the architectures llama.cpp writes beyond Llama, made tiny from a random
transformers model with gguf's own writer and names: the engine's logits equal transformers'
on the same file (transformers reads GGUF with its own name map)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.gguf_model import prepare_gguf
from engine.kernels.moe_int4 import kernel_serves as moe_int4_kernel_serves
from engine.layers.moe import EachExpert, FusedMoE
from engine.quantization.int4 import Int4Linear
from engine.quantization.int4_experts import Int4Experts
from engine.quantization.q8_0 import Q8_0Linear
from engine.weights.loader import load_model
from tests.model_fixtures import TINY_LLAMA, build_tiny_hf_model
from tests.test_engine import prompt_of
from tests.test_gguf import permute_rotary
from tests.test_model_parity import prefill_logits

# transformers reads a Qwen3 GGUF's head size as its config's default (128), not the file's.
# Gemma 2's GGUF config is read with transformers' defaults too (head size 256, query scalar
# 256, caps 50 and 30); the case keeps them, with a 12-token window.
CASES = {"qwen2": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 128},
         "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 12,
                    "tie_word_embeddings": True}}


def write_gguf(path: Path, architecture: str, hf_model: torch.nn.Module) -> None:
    import gguf

    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(TINY_LLAMA["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    for hf_name, tensor in hf_model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        if config.tie_word_embeddings and base == "lm_head":
            continue
        weight = tensor.float().numpy()
        if architecture.startswith("gemma") and base.endswith("norm"):
            weight = weight + 1  # llama.cpp stores Gemma's norms as 1 + w
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture", CASES)
def test_a_gguf_of_the_architecture_equals_transformers(architecture: str,
                                                        tmp_path: Path) -> None:
    hf_model = build_tiny_hf_model(architecture, **CASES[architecture])
    path = tmp_path / f"tiny-{architecture}.gguf"
    write_gguf(path, architecture, hf_model)
    model_dir = prepare_gguf(str(path), tmp_path / "cache", with_tokenizer=False)
    ours = load_model(model_dir, torch.float32, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    prompt = prompt_of(30, 3)  # longer than Gemma 2's window
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (prefill_logits(ours, prompt) - expected).abs().max().item() < 1e-4


# What llama.cpp writes beyond one tensor per HF weight: experts stacked into `ffn_*_exps`
# (Mixtral under the "llama" architecture, its q/k rows permuted for llama.cpp's rope),
# Phi-3's fused qkv and gate_up and its LongRoPE factors as tensors.
MORE_CASES = {
    "qwen3moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "llama-moe": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                              "intermediate_size": 32}),
    "phi3": ("phi3", {"original_max_position_embeddings": 100, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 0.5 * i for i in range(8)]}}),
}


def gguf_tensors_of(hf_model: torch.nn.Module, architecture: str) -> dict[str, np.ndarray]:
    """GGUF name -> array, as llama.cpp's converter names and lays out the weights."""
    import gguf

    config = hf_model.config
    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in hf_model.state_dict().items():
        weight = tensor.float().numpy()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * width, hidden]
            half = weight.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = weight[:, :half]
            out[f"blk.{layer}.ffn_up_exps.weight"] = weight[:, half:]
        elif hf_name.endswith("mlp.experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = weight
        elif hf_name.endswith("mlp.gate.weight"):  # the router
            out[f"blk.{layer}.ffn_gate_inp.weight"] = weight
        elif hf_name.endswith("mlp.gate_up_proj.weight"):  # Phi-3: gate and up in one
            out[f"blk.{layer}.ffn_up.weight"] = weight
        elif hf_name.endswith("self_attn.qkv_proj.weight"):
            out[f"blk.{layer}.attn_qkv.weight"] = weight
        else:
            base, _, suffix = hf_name.rpartition(".")
            if architecture == "llama" and base.endswith(("q_proj", "k_proj")):
                heads = (config.num_attention_heads if base.endswith("q_proj")
                         else config.num_key_value_heads)
                weight = permute_rotary(weight, heads)
            out[f"{names.get_name(base)}.{suffix}"] = weight
    return out


def write_more_gguf(path: Path, case: str, hf_model: torch.nn.Module,
                    expert_types: tuple[str, str] | None = None) -> None:
    """A MORE_CASES model as llama.cpp writes it; its stacked experts' gate and up, and down,
    quantized to `expert_types` (gguf's own quantizer) where they are given."""
    import gguf

    model_type, overrides = MORE_CASES[case]
    architecture = "llama" if case == "llama-moe" else case
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(getattr(config, "intermediate_size", 0))
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(TINY_LLAMA["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    tensors = gguf_tensors_of(hf_model, architecture)
    if model_type != "phi3":
        writer.add_expert_count(4)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(32)
    else:
        writer.add_rope_scaling_orig_ctx_len(100)
        scaling = overrides["rope_scaling"]
        tensors["rope_factors_long.weight"] = np.array(scaling["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(scaling["short_factor"], np.float32)
    for name, weight in tensors.items():
        weight = np.ascontiguousarray(weight)
        if expert_types is not None and "_exps." in name:
            kind = gguf.GGMLQuantizationType[expert_types["down_exps" in name]]
            writer.add_tensor(name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case", MORE_CASES)
def test_stacked_experts_and_fused_phi3_weights_equal_the_source_model(
        case: str, tmp_path: Path) -> None:
    model_type, overrides = MORE_CASES[case]
    hf_model = build_tiny_hf_model(model_type, **overrides)
    path = tmp_path / f"tiny-{case}.gguf"
    write_more_gguf(path, case, hf_model)
    model_dir = prepare_gguf(str(path), tmp_path / "cache", with_tokenizer=False)
    ours = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert ours.config.model_type == model_type
    prompt = prompt_of(60, 5)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    assert (prefill_logits(ours, prompt) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("case, expert_types", [
    ("qwen3moe", ("Q4_0", "Q4_0")), ("llama-moe", ("Q4_1", "Q4_1")),
    ("qwen3moe", ("Q8_0", "Q8_0")),
    ("qwen3moe", ("Q4_1", "Q8_0")),  # as Q4_K_M writes some layers: down in more bits
])
def test_quantized_stacked_experts_keep_the_files_codes(case: str, expert_types: tuple[str, str],
                                                        tmp_path: Path) -> None:
    """A Qwen3-MoE or Mixtral GGUF's quantized experts load as their codes (no float copy of
    them, nor a dense copy beside them), decode exactly as the file's own dequantization, and
    the model's logits are float math on those weights, for a few rows per expert and for a
    prefill's many."""
    model_type, overrides = MORE_CASES[case]
    hf_model = build_tiny_hf_model(model_type, **overrides)
    path = tmp_path / f"tiny-{case}.gguf"
    write_more_gguf(path, case, hf_model, expert_types)
    model_dir = prepare_gguf(str(path), tmp_path / "cache", with_tokenizer=False)
    cpu = torch.device("cpu")
    ours = load_model(model_dir, torch.float32, cpu)
    floats = load_model(model_dir, torch.float32, cpu, quantization="none")
    kinds = [Q8_0Linear if kind == "Q8_0" else Int4Linear for kind in expert_types]
    theirs_by_name = dict(floats.named_modules())
    pairs = [(mine, theirs_by_name[name]) for name, mine in ours.named_modules()
             if isinstance(mine, FusedMoE)]
    assert pairs
    for mine, theirs in pairs:
        assert mine.w13 is None and mine.projections is not None  # fp32: a layer per expert
        for projection, kind, weights in zip(mine.projections, kinds, (theirs.w13, theirs.w2),
                                             strict=True):
            assert isinstance(projection, EachExpert)
            for expert, layer in enumerate(projection.layers):
                assert isinstance(layer, kind) and layer.dense is None
                assert torch.equal(layer.dequantized_weight(), weights[expert])
    for prompt in (prompt_of(3, 7), prompt_of(60, 5)):
        want = prefill_logits(floats, prompt)
        assert (prefill_logits(ours, prompt) - want).abs().max().item() < 1e-4
    if expert_types[0] == "Q8_0" or not moe_int4_kernel_serves(torch.bfloat16, 32, 16, 32):
        return
    # bf16 on AVX512-BF16: every int4 projection of the experts is one grouped weight
    grouped = load_model(model_dir, torch.bfloat16, cpu)
    for name, moe in grouped.named_modules():
        if isinstance(moe, FusedMoE):
            assert [type(projection) for projection in moe.projections] == [
                Int4Experts if kind is Int4Linear else EachExpert for kind in kinds]
            held = theirs_by_name[name].w13[1], moe.projections[0].dequantized_weight(1)
            assert (held[0] - held[1]).abs().max() <= held[0].abs().max() * 2 ** -7
    bf16_floats = load_model(model_dir, torch.bfloat16, cpu, quantization="none")
    for prompt in (prompt_of(3, 7), prompt_of(60, 5)):  # bf16 math: a row's error, typically
        want = prefill_logits(bf16_floats, prompt).float()
        rows_error = (prefill_logits(grouped, prompt).float() - want).abs().amax(dim=1)
        assert rows_error.median().item() < 0.02 * want.abs().max().item()
