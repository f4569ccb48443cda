"""A llama.cpp GGUF file read as a Hugging Face model: its config from the file's metadata,
its tensors' names and layouts (dequantized, llama.cpp's rotary permutation of q/k undone),
its tokenizer and chat template (common.gguf_tokenizer); `convert_gguf` writes all of it as an
ordinary float32 directory. Used for the embedded default model (common.default_model), for `--model
FILE.gguf` (common.gguf_model) and by the engine's GGUF loader (engine.weights.gguf).

Importable without torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.gguf_tokenizer import write_tokenizer

Progress = Callable[[str], None]

_LLAMA_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """How llama.cpp writes one architecture: its Hugging Face names, and what its converter
    changed that reading must undo. A layer tensor whose name holds `{}` stacks every
    expert's weight (llama.cpp's `ffn_*_exps`): it reads as one tensor per expert."""

    model_type: str  # the Hugging Face config's
    hf_class: str
    layer_tensors: dict[str, str]
    rotary_permuted: bool  # q/k rows interleaved for llama.cpp's rope (Llama only)
    norm_offset: float = 0.0  # llama.cpp stores Gemma's norms as 1 + w


_QWEN3_LAYER_TENSORS = {
    **_LLAMA_LAYER_TENSORS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

_GEMMA_LAYER_TENSORS = {
    **_LLAMA_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", _LLAMA_LAYER_TENSORS, True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", _LLAMA_LAYER_TENSORS, False),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", _QWEN3_LAYER_TENSORS,
                              rotary_permuted=False),
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", {
        **_QWEN3_LAYER_TENSORS,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{}.gate_proj",
        "ffn_up_exps": "mlp.experts.{}.up_proj",
        "ffn_down_exps": "mlp.experts.{}.down_proj",
    }, rotary_permuted=False),
    "phi3": GGUFArchitecture("phi3", "Phi3ForCausalLM", {
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",  # gate and up stacked, as Phi-3's own checkpoint
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }, rotary_permuted=False),
    "gemma2": GGUFArchitecture("gemma2", "Gemma2ForCausalLM", _GEMMA_LAYER_TENSORS,
                               rotary_permuted=False, norm_offset=1.0),
    "gemma3": GGUFArchitecture("gemma3_text", "Gemma3ForCausalLM", {
        **_GEMMA_LAYER_TENSORS,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }, rotary_permuted=False, norm_offset=1.0),
}
# llama.cpp writes Mixtral as "llama" with an expert count.
LLAMA_MOE = GGUFArchitecture("mixtral", "MixtralForCausalLM", {
    **_LLAMA_LAYER_TENSORS,
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{}.w2",
}, rotary_permuted=True)
BY_MODEL_TYPE = {arch.model_type: arch for arch in (*GGUF_ARCHITECTURES.values(), LLAMA_MOE)}
# Tensors that are configuration, not weights: Phi-3's LongRoPE factors.
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
GEMMA3_SLIDING_PATTERN = 6  # every sixth layer global, as transformers' Gemma3 defaults
GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def convert_gguf(gguf_path: Path, out: Path, progress: Progress = print) -> None:
    """Write a float32 Hugging Face Llama directory from a llama.cpp Llama GGUF file."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    metadata = read_metadata(reader)
    gguf_architecture(metadata)
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = hf_config_from_gguf(metadata, tied="output.weight" not in tensor_names,
                                 vocab_size=embedding_rows(reader.tensors),
                                 rope_factors=rope_factor_tensors(reader.tensors))
    tensors = _dequantize_all(reader, config, progress)
    progress("writing model.safetensors (float32), config.json, generation_config.json")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    del tensors
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(config))
    write_tokenizer(gguf_path, out, progress)


def read_metadata(reader: Any) -> dict[str, Any]:
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
            "tokenizer.ggml.scores")
    return {key: field.contents() for key, field in reader.fields.items() if key not in skip}


def gguf_architecture(metadata: dict[str, Any]) -> GGUFArchitecture:
    name = metadata.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported; Loom reads GGUF files of "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))} (Mixtral as llama)")
    if name == "llama" and metadata.get("llama.expert_count"):
        return LLAMA_MOE
    return GGUF_ARCHITECTURES[name]


def embedding_rows(tensors: list[Any]) -> int:
    """The vocabulary as the token embedding counts it (a GGUF need not say it elsewhere)."""
    return next(int(tensor.shape[-1]) for tensor in tensors if tensor.name == "token_embd.weight")


def hf_config_from_gguf(metadata: dict[str, Any], tied: bool, vocab_size: int = 0,
                        rope_factors: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """`rope_factors`: a Phi-3 file's LongRoPE factors (see `rope_factor_tensors`)."""
    arch = metadata["general.architecture"]
    architecture = gguf_architecture(metadata)

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    eos = int(metadata.get("tokenizer.ggml.eos_token_id", 2))
    config = {
        "architectures": [architecture.hf_class],
        "model_type": architecture.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _clean_float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(get("vocab_size", 0)) or vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(metadata.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": eos,
        "pad_token_id": int(metadata.get("tokenizer.ggml.padding_token_id", eos)),
        "dtype": "float32",
    }
    if arch == "gemma3":
        config.update(_gemma3_config(get, config))
    if arch == "gemma2":
        config.update(_gemma2_config(get, config))
    if arch in ("qwen3", "qwen3moe"):  # its heads are not hidden / heads wide
        config["head_dim"] = int(get("attention.key_length", config["head_dim"]))
    if architecture.model_type in ("qwen3_moe", "mixtral"):
        config.update(_moe_config(get, config, architecture.model_type))
    if arch == "phi3":
        config.update(_phi3_config(get, config, rope_factors or {}))
    return config


def _moe_config(get: Callable[..., Any], config: dict[str, Any],
                model_type: str) -> dict[str, Any]:
    """Routed experts: llama.cpp renormalises Qwen3-MoE's top-k weights (as Mixtral's)."""
    experts, used = int(get("expert_count")), int(get("expert_used_count"))
    if model_type == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": used,
                "sliding_window": None}
    expert_width = int(get("expert_feed_forward_length", config["intermediate_size"]))
    return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": True,
            "moe_intermediate_size": expert_width, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def _phi3_config(get: Callable[..., Any], config: dict[str, Any],
                 rope_factors: dict[str, list[float]]) -> dict[str, Any]:
    """Phi-3: LongRoPE when the file carries its factors, its window if it has one."""
    extra: dict[str, Any] = {"sliding_window": get("attention.sliding_window")}
    original = get("rope.scaling.original_context_length")
    if rope_factors:
        extra["rope_scaling"] = {"type": "longrope", "long_factor": rope_factors["long"],
                                 "short_factor": rope_factors["short"]}
        extra["original_max_position_embeddings"] = int(original or config[
            "max_position_embeddings"])
    return extra


def rope_factor_tensors(tensors: list[Any]) -> dict[str, list[float]]:
    """A Phi-3 file's LongRoPE factors ({"long": ..., "short": ...}), or none."""
    factors = {tensor.name.removeprefix("rope_factors_").removesuffix(".weight"): [
        _clean_float(value) for value in np.asarray(tensor.data, dtype=np.float32).ravel()]
        for tensor in tensors if tensor.name in CONFIG_TENSORS}
    return factors if len(factors) == 2 else {}


def _gemma_config(get: Callable[..., Any], config: dict[str, Any],
                  sliding: Callable[[int], bool]) -> dict[str, Any]:
    """What a Gemma GGUF leaves to transformers' Gemma defaults, spelled out: queries scaled
    by the head size, GELU-tanh, and which layers slide."""
    head_dim = int(get("attention.key_length", config["head_dim"]))
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if sliding(index) else "full_attention"
                        for index in range(config["num_hidden_layers"])],
    }


def _gemma2_config(get: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2: alternating sliding and global layers, and its soft caps (from the file, or
    transformers' Gemma2 defaults)."""
    return {
        **_gemma_config(get, config, lambda index: index % 2 == 0),
        "attn_logit_softcapping": _clean_float(get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _clean_float(get("final_logit_softcapping", 30.0)),
    }


def _gemma3_config(get: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3: every sixth layer global, the sliding ones with their own rotary base."""
    global_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if get("rope.scaling.type") == "linear":
        global_rope = {**global_rope, "rope_type": "linear",
                       "factor": float(get("rope.scaling.factor"))}
    return {
        **_gemma_config(get, config,
                        lambda index: (index + 1) % GEMMA3_SLIDING_PATTERN != 0),
        "rope_parameters": {"full_attention": global_rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _clean_float(value: float) -> float:
    """GGUF stores float32; 9.99999974e-06 should read back as the 1e-05 it was."""
    return float(str(np.float32(value)))


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _dequantize_all(reader: Any, config: dict[str, Any],
                    progress: Progress) -> dict[str, np.ndarray]:
    total = len(reader.tensors)
    step = max(1, total // 8)
    tensors: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(reader.tensors, start=1):
        tensors.update(dequantize_tensor(tensor, config))
        if index % step == 0 or index == total:
            progress(f"dequantizing {index}/{total} tensors")
    return tensors


def dequantize_tensor(tensor: Any, config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array in its layout) of one GGUF tensor: one per expert
    for stacked experts, none for a configuration tensor."""
    from gguf.quants import dequantize

    if tensor.name in CONFIG_TENSORS:
        return []
    architecture = BY_MODEL_TYPE[config.get("model_type", "llama")]
    name = hf_tensor_name(tensor.name, architecture.model_type)
    if tensor.tensor_type.name == "Q8_0":
        weight = dequantize_q8_0(tensor.data)
    else:
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    weight = weight.reshape([int(dim) for dim in reversed(tensor.shape)])
    if architecture.norm_offset and name.endswith("norm.weight"):
        weight = weight - np.float32(architecture.norm_offset)
    if "{}" in name:
        return [(name.format(expert), np.ascontiguousarray(weight[expert]))
                for expert in range(weight.shape[0])]
    return [(name, np.ascontiguousarray(unpermute_if_rotary(name, weight, config)))]


Q8_0_BLOCK = 32  # codes per Q8_0 block, after its fp16 scale


def q8_0_codes_and_scales(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [rows, K], d float32 [rows, K / 32]) of Q8_0 bytes [rows, bytes of a row],
    W = q·d."""
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, -1, 2 + Q8_0_BLOCK)
    scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return q, scale


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 bytes [..., bytes of a row] as float32 q·d, the same values as gguf's `dequantize`
    in one vectorized pass (gguf's runs chunk by chunk: 0.47 s of the default model's start
    for its 28M-value embedding)."""
    q, scale = q8_0_codes_and_scales(data.reshape(-1, data.shape[-1]))
    grouped = q.reshape(q.shape[0], -1, Q8_0_BLOCK).astype(np.float32)
    return (grouped * scale[..., None]).reshape(*data.shape[:-1], -1)


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    layer_tensors = BY_MODEL_TYPE[model_type].layer_tensors
    layer = _LAYER_NAME.fullmatch(gguf_name)
    if layer:
        index, kind, suffix = layer.groups()
        if kind not in layer_tensors:
            raise ValueError(f"unsupported GGUF tensor {gguf_name}")
        return f"model.layers.{index}.{layer_tensors[kind]}.{suffix}"
    base, _, suffix = gguf_name.rpartition(".")
    if base not in _GLOBAL_TENSORS:
        raise ValueError(f"unsupported GGUF tensor {gguf_name}")
    return f"{_GLOBAL_TENSORS[base]}.{suffix}"


def unpermute_if_rotary(name: str, weight: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if not BY_MODEL_TYPE[config.get("model_type", "llama")].rotary_permuted:
        return weight
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute_rotary(weight, config["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute_rotary(weight, config["num_key_value_heads"])
    return weight


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation (interleaved rotary pairs → HF half-split)."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
