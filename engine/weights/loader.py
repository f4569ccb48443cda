"""Load a Hugging Face Llama-family directory (config.json + safetensors) into our model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from common.gguf_model import gguf_source
from engine.distributed.tensor_parallel import TPShard, shard_model
from engine.layers.linear import prepack_linears
from engine.models.llama import LlamaForCausalLM, ModelConfig
from engine.quantization.linear import DEFAULT_GROUP_SIZE, attach_dense_copies, quantize_linears
from engine.weights.gguf import codes_only, float_tensors, keep_gguf_quantization, kept_groups
from engine.weights.gguf_file import read_tensors

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})

# HF projection name -> (our merged parameter, part index, number of parts)
_MERGED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
}
_LAYER_PARAM = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)\.(weight|bias)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device,
               quantization: str = "auto",
               group_size: int = DEFAULT_GROUP_SIZE,
               shard: TPShard | None = None) -> LlamaForCausalLM:
    """The model on `device`, its linears quantized if asked (engine.quantization.linear), else
    prepacked where that pays (engine.layers.linear). A directory standing for a GGUF file
    (common.gguf_model) reads the file; `auto` keeps its Q4_0/Q4_1/Q4_K linears as they are,
    except in fp32 (torch's int4 kernels are slow there). One that also holds safetensors
    (the default model) reads those whenever it does not keep the codes: the same floats,
    read faster. With a tensor-parallel `shard`, the float weights are cut to this rank's
    slices first (a GGUF's codes are not kept then)."""
    directory = Path(model_dir)
    hf_config = read_hf_config(directory)
    config = ModelConfig.from_hf(hf_config)
    config.eos_token_ids = _merge_generation_eos(directory, config.eos_token_ids)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype)
    source = gguf_source(directory)
    keep_codes = (source is not None and quantization == "auto" and dtype != torch.float32
                  and shard is None)
    if source is not None and (keep_codes or not any(directory.glob("*.safetensors"))):
        gguf_tensors = read_tensors(source)
        groups = kept_groups(gguf_tensors, hf_config) if keep_codes else {}
        skip = codes_only(groups)
        tensors = float_tensors(gguf_tensors, hf_config, skip)
    else:
        tensors = _read_safetensors(directory, device)
    weights = dict(_merged_weights(tensors, dtype))
    _tie_or_check_lm_head(model, weights)
    model.load_state_dict(weights, strict=True, assign=True)
    model = model.to(device).eval().requires_grad_(False)
    if shard is not None:
        shard_model(model, shard)
    if keep_codes:
        attach_dense_copies(
            keep_gguf_quantization(model, gguf_tensors, groups, hf_config, dtype))
    else:
        quantize_linears(model, "none" if quantization == "auto" else quantization, group_size)
    prepack_linears(model, device, dtype)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds, in the form it holds them (packed, quantized)."""
    total = 0
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   getattr(module, "packed_weight", None)]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def read_hf_config(directory: Path) -> dict:
    hf_config = json.loads((directory / "config.json").read_text())
    model_type = hf_config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {directory}; "
                         f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    return hf_config


def _merge_generation_eos(directory: Path, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """generation_config.json often lists more stop ids (Llama 3 Instruct's <|eot_id|>)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return eos_ids
    extra = json.loads(path.read_text()).get("eos_token_id")
    extra_ids = [extra] if isinstance(extra, int) else list(extra or [])
    return tuple(dict.fromkeys([*eos_ids, *extra_ids]))


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


def _read_safetensors(directory: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device=str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if not _IGNORED.fullmatch(name):
                    yield name, shard.get_tensor(name)


def _merged_weights(tensors: Iterator[tuple[str, torch.Tensor]],
                    dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename HF tensors onto our parameters, concatenating merged projections."""
    pending: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in tensors:
        tensor = tensor.to(dtype)
        match = _LAYER_PARAM.fullmatch(name)
        if match is None or match.group(2) not in _MERGED_PARTS:
            yield name, tensor
            continue
        layer, projection, kind = match.groups()
        merged, part, num_parts = _MERGED_PARTS[projection]
        target = f"model.layers.{layer}.{merged}.{kind}"
        parts = pending.setdefault(target, [None] * num_parts)
        parts[part] = tensor
        if all(p is not None for p in parts):
            yield target, torch.cat(pending.pop(target), dim=0)  # type: ignore[arg-type]
    if pending:
        raise ValueError(f"checkpoint is missing parts of {sorted(pending)}")


def _tie_or_check_lm_head(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Tied models read the embedding; a checkpoint without lm_head.weight is tied too."""
    if model.lm_head is None:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        model.lm_head = None
        model.config.tie_word_embeddings = True
