"""Load a Hugging Face directory (config.json + safetensors) or a GGUF file into our model."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from common.gguf_convert import hf_tensor_name
from common.gguf_model import gguf_source
from engine.distributed.tensor_parallel import tp_shard
from engine.layers.linear import CheckpointTensor
from engine.models.config import ModelConfig
from engine.models.registry import model_class
from engine.quantization.base import DEFAULT_GROUP_SIZE
from engine.quantization.registry import attach_dense_copies, quantize_linears
from engine.quantization.unquantized import prepack_linears
from engine.weights.gguf import codes_only, float_tensors, keep_gguf_quantization, kept_groups
from engine.weights.gguf_file import read_tensors
from engine.weights.safetensors import read_safetensors
from engine.weights.targets import load_weights


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device,
               quantization: str = "auto",
               group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """The model on `device` at this tensor-parallel rank's size (its layers read only their
    share of each tensor), its linears quantized if asked (engine.quantization), else
    prepacked where that pays. A directory standing for a GGUF file (common.gguf_model) reads
    the file; `auto` keeps its Q4_0/Q4_1/Q4_K/Q8_0 linears as they are (in bf16 and fp32
    alike), except under tensor parallelism; `w4a8` too, its 4-bit ones with 8-bit
    activations. One that also holds safetensors (the default
    model) reads those whenever it does not keep the codes (`none`): the float weights."""
    directory = Path(model_dir)
    hf_config = read_hf_config(directory)
    config = ModelConfig.from_hf(hf_config)
    config.eos_token_ids = _merge_generation_eos(directory, config.eos_token_ids)
    with torch.device("meta"):
        model = model_class(config.model_type)(config, dtype=dtype)
    source = gguf_source(directory)
    keep_codes = (source is not None and quantization in ("auto", "w4a8")
                  and tp_shard().size == 1)
    elsewhere: frozenset[str] = frozenset()
    if source is not None and (keep_codes or not any(directory.glob("*.safetensors"))):
        gguf_tensors = read_tensors(source)
        groups = kept_groups(model, gguf_tensors) if keep_codes else {}
        skip = codes_only(groups)
        elsewhere = frozenset(expert_name for name in skip for expert_name in
                              expert_names(hf_tensor_name(name, config.model_type), config))
        tensors: Iterable[tuple[str, CheckpointTensor]] = float_tensors(gguf_tensors, hf_config,
                                                                       skip)
    else:
        tensors = read_safetensors(directory, device)
    load_weights(model, tensors, device, elsewhere)
    model = model.to(device).eval().requires_grad_(False)
    if keep_codes:
        attach_dense_copies(
            keep_gguf_quantization(model, gguf_tensors, groups, hf_config, dtype,
                                   int8_activations=quantization == "w4a8"))
    else:
        quantize_linears(model, "none" if quantization == "auto" else quantization, group_size)
    prepack_linears(model, device, dtype)
    return model


def expert_names(name: str, config: ModelConfig) -> list[str]:
    """A stacked experts' name (`...experts.{}.gate_proj.weight`) as every expert's."""
    if "{}" not in name or config.moe is None:
        return [name]
    return [name.format(expert) for expert in range(config.moe.num_experts)]


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
    model_class(hf_config.get("model_type", "llama"))  # refuses an unknown architecture
    return hf_config


def _merge_generation_eos(directory: Path, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """generation_config.json often lists more stop ids (Llama 3 Instruct's <|eot_id|>)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return eos_ids
    extra = json.loads(path.read_text()).get("eos_token_id")
    extra_ids = [extra] if isinstance(extra, int) else list(extra or [])
    return tuple(dict.fromkeys([*eos_ids, *extra_ids]))
