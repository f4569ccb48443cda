"""Weights read from a GGUF file (`--model FILE.gguf`, see common/gguf_model.py).

Every tensor can be read dequantized to float32 (`float_tensors`, as the default model's
conversion does). With `--quantization auto` the linears whose GGUF tensors are Q4_0, Q4_1
or Q4_K are then replaced by `Int4Linear`s holding the file's own codes
(`keep_gguf_quantization`): a block of 32 weights with an fp16 scale d (and, Q4_1, minimum m)
is exactly a group of 32 with scale d and zero at code 8 of 0 (Q4_0) or m + 8·d (Q4_1); a
Q4_K super-block is eight such groups (`_q4_k_codes`). Scale and zero are held in the
model's dtype (bf16 rounds them to 8 bits of mantissa). Q8_0 linears become `Q8_0Linear`s
holding the codes and scales exactly, and so do Q5_0 ones: a Q5_0 block (fp16 d, 5-bit codes
q, W = (q - 16)·d) is exactly a Q8_0 block of codes q - 16 (`q5_0_codes`); and Q6_K ones, as
int8 codes q - 32 with a scale per 16 (`q6_k_codes`; their 32-blocked neighbours in a fused
linear repeat each scale twice). llama.cpp writes Q5_0 where a K-quant's 256-wide
super-blocks do not fit a row (Gemma 3 270M's 640-wide inputs). A tied output projection
is made from the embedding's codes, the embedding itself staying float for the lookup.
Routed experts stacked as llama.cpp writes them (`ffn_{gate,up,down}_exps`: gate and up
of one kind of codes, down of either) keep their codes too, a layer per expert
(`expert_layers`), or one grouped int4 weight per projection where that kernel serves
(engine.layers.moe).
Other quantized types (Q5_K, Q2_K, ...) stay float, named in one warning line.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from common.gguf_convert import (
    CONFIG_TENSORS,
    dequantize_tensor,
    hf_tensor_name,
    q8_0_codes_and_scales,
    unpermute_if_rotary,
)
from engine.layers.linear import LinearBase
from engine.layers.moe import FusedMoE
from engine.quantization.base import QuantizedLinear
from engine.quantization.int4 import Int4Linear
from engine.quantization.q8_0 import Q8_0Linear
from engine.weights.gguf_file import GGUFTensor

logger = logging.getLogger("loom.engine")

GGUF_BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # all exactly groups of 32 with scale, zero
# Exactly int8 codes with one scale per 32 input channels (Q6_K: per 16)
INT8_TYPES = frozenset({"Q8_0", "Q5_0", "Q6_K"})
TIED_EMBEDDING = "token_embd.weight"


def float_tensors(tensors: list[GGUFTensor], config: dict[str, Any],
                  skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file but those named in
    `skip` (GGUF names, about to be replaced by their codes)."""
    for tensor in tensors:
        if tensor.name in skip:
            continue
        for name, weight in dequantize_tensor(tensor, config):
            yield name, torch.from_numpy(weight if weight.flags.writeable else weight.copy())


def kept_groups(model: nn.Module, tensors: list[GGUFTensor]) -> dict[str, list[GGUFTensor]]:
    """Module name (`model.layers.3.self_attn.qkv_proj`, `lm_head`) → the GGUF tensors whose
    codes it will hold: every linear the model declares whose tensors are all 4-bit
    (INT4_TYPES) or all int8 codes (INT8_TYPES), every set of routed experts (llama.cpp's
    stacked `ffn_{gate,up,down}_exps`) whose gate and up are and whose down is (Q4_K_M writes
    some layers' down as Q6_K), and the output projection (the embedding's codes, if tied)."""
    by_name = {hf_tensor_name(tensor.name, model.config.model_type): tensor for tensor in tensors
               if tensor.name not in CONFIG_TENSORS}
    candidates = {name: linear_checkpoint_names(name, module)
                  for name, module in model.named_modules() if isinstance(module, LinearBase)}
    experts = {name: [f"{name}.experts.{{}}.{part}.weight" for part in module.expert_parts]
               for name, module in model.named_modules() if isinstance(module, FusedMoE)}
    candidates.update(experts)
    candidates["lm_head"] = ["model.embed_tokens.weight" if model.lm_head is None
                             else "lm_head.weight"]
    groups = {module: [by_name[name] for name in names] for module, names in candidates.items()}
    return {module: members for module, members in groups.items()
            if all(one_kind(part) for part in
                   ((members[:2], members[2:]) if module in experts else (members,)))}


def one_kind(members: list[GGUFTensor]) -> bool:
    """Whether the tensors are all 4-bit codes (INT4_TYPES) or all int8 ones (INT8_TYPES)."""
    kinds = {member.tensor_type.name for member in members}
    return kinds <= INT4_TYPES or kinds <= INT8_TYPES


def linear_checkpoint_names(name: str, linear: LinearBase) -> list[str]:
    """The checkpoint's weights a declared linear is made of, in its order."""
    parent = name.rpartition(".")[0]
    return [f"{parent}.{part}.weight" for part in linear.parts] or [f"{name}.weight"]


def codes_only(groups: dict[str, list[GGUFTensor]]) -> frozenset[str]:
    """GGUF names held only as codes: no float copy to read (the tied embedding needs one)."""
    return frozenset(member.name for members in groups.values() for member in members
                     if member.name != TIED_EMBEDDING)


def stacked_rows(tensor: Any) -> int:
    """Rows of a tensor's codes: its output channels, of every expert where experts stack."""
    return int(np.prod([int(dim) for dim in tensor.shape[1:]]))


def q4_codes(tensor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8 [N, K] in 0..15, scale float32 [N, K/32], zero float32 [N, K/32]) of a Q4_0,
    Q4_1 or Q4_K tensor, W = (q - 8)·scale + zero."""
    if tensor.tensor_type.name == "Q4_K":
        return _q4_k_codes(tensor)
    kind = tensor.tensor_type.name
    rows = stacked_rows(tensor)
    head = 4 if kind == "Q4_1" else 2  # fp16 d (and m), then 16 bytes of codes
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, head + GGUF_BLOCK // 2)
    halves = blocks[..., :head].copy().view(np.float16).astype(np.float32)
    scale = halves[..., 0]
    codes = blocks[..., head:]
    # Byte j of a block holds code j in its low nibble and code j + 16 in its high one.
    q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).reshape(rows, -1)
    zero = halves[..., 1] + 8 * scale if kind == "Q4_1" else np.zeros_like(scale)
    return q, scale, zero


def _q4_k_codes(tensor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K super-block (256 weights: fp16 d and dmin, twelve bytes of 6-bit scales and
    mins, 128 bytes of codes) is eight groups of 32 with W = d·sc·q - dmin·m: group scale
    d·sc, zero at code 8 of 8·d·sc - dmin·m."""
    rows = stacked_rows(tensor)
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, 144)
    d, dmin = (blocks[..., i:i + 2].copy().view(np.float16).astype(np.float32)[..., 0]
               for i in (0, 2))
    packed = blocks[..., 4:16].astype(np.uint16)
    low6 = packed[..., 0:8] & 0x3F  # groups 0-3: scales in bytes 0-3, mins in bytes 4-7
    high = packed[..., 8:12]  # groups 4-7: low four bits here, top two in bytes 0-7's bits 6-7
    scales = np.concatenate([low6[..., 0:4], (high & 0x0F) | ((packed[..., 0:4] >> 6) << 4)],
                            axis=-1)
    mins = np.concatenate([low6[..., 4:8], (high >> 4) | ((packed[..., 4:8] >> 6) << 4)],
                          axis=-1)
    codes = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 chunks of 64 weights each
    # Chunk c's byte i holds weight 64c + i in its low nibble and 64c + 32 + i in its high one.
    q = np.stack([codes & 0x0F, codes >> 4], axis=-2).reshape(rows, -1)
    scale = (d[..., None] * scales).reshape(rows, -1)
    zero = (8 * d[..., None] * scales - dmin[..., None] * mins).reshape(rows, -1)
    return q, scale.astype(np.float32), zero.astype(np.float32)


def int8_codes(tensor: Any, block: int = GGUF_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [N, K], d float32 [N, K / block]) of a Q8_0, Q5_0 or Q6_K tensor, W = q·d:
    a scale per 16 input channels (Q6_K's own) when `block` is 16."""
    kind = tensor.tensor_type.name
    read = {"Q5_0": q5_0_codes, "Q6_K": q6_k_codes}.get(kind, q8_0_codes)
    q, scale = read(tensor)
    return q, np.repeat(scale, q.shape[1] // scale.shape[1] // block, axis=1)


def q6_k_codes(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Q6_K super-block (256 weights: 128 bytes of low nibbles, 64 of high bit pairs, 16
    int8 sub-block scales, fp16 d) as int8 codes q - 32 in -32..31 with a scale d·sc per 16:
    W = d·sc·(q - 32)."""
    rows = stacked_rows(tensor)
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, 210)
    low, high = blocks[..., :128], blocks[..., 128:192]
    sub_scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)
    halves = []
    for half in range(2):  # each 128 weights: 64 bytes of low nibbles, 32 of high pairs
        ql, qh = low[..., 64 * half:64 * half + 64], high[..., 32 * half:32 * half + 32]
        halves += [(ql[..., :32] & 0x0F) | ((qh & 3) << 4),
                   (ql[..., 32:] & 0x0F) | (((qh >> 2) & 3) << 4),
                   (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),
                   (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    q = np.concatenate(halves, axis=-1).astype(np.int8) - np.int8(32)
    return q.reshape(rows, -1), (d * sub_scales).reshape(rows, -1)


def q5_0_codes(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Q5_0 block (fp16 d, 4 bytes of fifth bits, 16 bytes of low nibbles) as int8 codes
    q - 16 in -16..15 with the block's d: W = (q - 16)·d."""
    rows = stacked_rows(tensor)
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, 2 + 4 + GGUF_BLOCK // 2)
    scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    high_bits = blocks[..., 2:6].copy().view(np.uint32)  # bit j: the fifth bit of code j
    fifth = (high_bits >> np.arange(GGUF_BLOCK, dtype=np.uint32)) & 1
    nibbles = blocks[..., 6:]
    # Byte j holds code j in its low nibble and code j + 16 in its high one.
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    q = (low | (fifth.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    return q.reshape(rows, -1), scale


def q8_0_codes(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [N, K], d float32 [N, K/32]) of a Q8_0 tensor (blocks: fp16 d, 32 int8 codes),
    W = q·d."""
    data = np.asarray(tensor.data, dtype=np.uint8)
    return q8_0_codes_and_scales(data.reshape(stacked_rows(tensor), -1))


def keep_gguf_quantization(model: nn.Module, tensors: list[GGUFTensor],
                           groups: dict[str, list[GGUFTensor]], config: dict[str, Any],
                           dtype: torch.dtype,
                           int8_activations: bool = False) -> list[QuantizedLinear]:
    """Replaces each linear of `groups` (see `kept_groups`) by a layer holding the file's
    codes (a tied `lm_head`, None until now, included); returns them. `int8_activations`:
    4-bit ones quantize their inputs per group of 32 (w4a8; routed experts stay weight-only).
    Logs the quantized types served as float instead."""
    made: list[QuantizedLinear] = []
    expert_sets = 0
    for module_name, members in groups.items():
        parent_name, _, attribute = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        declared = getattr(parent, attribute)
        if isinstance(declared, FusedMoE):
            gate_up, down = (expert_layers(declared, codes_of(part, config), dtype)
                             for part in (members[:2], members[2:]))
            made.extend(declared.hold_products(gate_up, down))
            expert_sets += 1
            continue
        arrays = [torch.from_numpy(np.concatenate(parts))
                  for parts in zip(*codes_of(members, config), strict=True)]
        bias = getattr(declared, "bias", None)
        made.append(coded_layer(arrays, bias, dtype, int8_activations))
        setattr(parent, attribute,
                declared.wrap(made[-1]) if isinstance(declared, LinearBase) else made[-1])
    kept = {member.name for members in groups.values() for member in members}
    _log_kept(tensors, kept, len(groups) - expert_sets, expert_sets)
    return made


def codes_of(members: list[GGUFTensor], config: dict[str, Any]) -> list[list[np.ndarray]]:
    """Each tensor's codes in a form they can be joined in: (q, scale, zero) of 4-bit ones,
    (q, scale) of int8 ones, with a scale per 16 inputs for all if one is Q6_K's."""
    is_q8 = members[0].tensor_type.name in INT8_TYPES
    block = 16 if any(member.tensor_type.name == "Q6_K" for member in members) else 32
    return [[unpermute_if_rotary(hf_tensor_name(member.name, config["model_type"]), array, config)
             for array in (int8_codes(member, block) if is_q8 else q4_codes(member))]
            for member in members]


def expert_layers(moe: FusedMoE, codes: list[list[np.ndarray]],
                  dtype: torch.dtype) -> list[QuantizedLinear]:
    """A layer per expert from stacked tensors' codes (`codes_of`; every array's rows are the
    experts' rows in turn), the tensors' rows joined (gate and up)."""
    def of_expert(arrays: list[np.ndarray], expert: int) -> torch.Tensor:
        return torch.cat([torch.from_numpy(array.reshape(moe.num_experts, -1,
                                                         array.shape[-1])[expert])
                          for array in arrays])

    made: list[QuantizedLinear] = []
    for expert in range(moe.num_experts):
        arrays = [of_expert(list(parts), expert) for parts in zip(*codes, strict=True)]
        made.append(coded_layer(arrays, None, dtype))
    return made


def coded_layer(arrays: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype,
                int8_activations: bool = False) -> QuantizedLinear:
    """A `Q8_0Linear` of (q, scale), an `Int4Linear` of (q, scale, zero) (`codes_of`), its
    activations quantized per group of 32 if asked (w4a8)."""
    if len(arrays) == 2:
        return Q8_0Linear(*arrays, bias, dtype)
    return Int4Linear.from_codes(*arrays, bias, dtype, int8_activations)


def _log_kept(tensors: list[GGUFTensor], kept: set[str], num_layers: int,
              expert_sets: int) -> None:
    served_float = Counter(kind for tensor in tensors if tensor.name not in kept
                           and (kind := tensor.tensor_type.name) not in _FLOAT_TYPES)
    if served_float:
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(served_float.items()))
        logger.warning("GGUF tensors served dequantized to float: %s (Q4_0, Q4_1, Q4_K, Q5_0, "
                       "Q6_K and Q8_0 linears alone keep their codes)", kinds)
    experts = f" and {expert_sets} layers' routed experts" if expert_sets else ""
    logger.info("GGUF: %d linears%s keep the file's codes (%d tensors)", num_layers, experts,
                len(kept))


_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
