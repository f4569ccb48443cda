"""Where each checkpoint tensor goes, read from the model's own layers.

A declared layer (engine.layers.linear, engine.layers.embedding) loads its tensors itself,
taking this rank's share; a merged one names the checkpoint's parts it stacks. Every other
parameter (norms) is replicated and copied whole. The model is built on the meta device:
its parameters are made real, uninitialized, on the target device just before loading.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.linear import CheckpointTensor, LinearBase, ParallelLMHead

TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class Target:
    """A parameter of `module` (`kind`: its attribute), or part `part` of a merged one."""

    module: nn.Module
    kind: str
    part: object = None  # which part of a merged parameter, as the layer numbers them

    def load(self, tensor: CheckpointTensor) -> None:
        load = getattr(self.module, "load", None)  # a layer that takes its own share
        if load is not None:
            load(self.kind, tensor, self.part)
        else:
            getattr(self.module, self.kind).data.copy_(tensor[:])


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint name -> its target, for every parameter the model holds."""
    targets: dict[str, Target] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        parent = name.rpartition(".")[0]
        names = getattr(module, "checkpoint_names", None)
        if names is not None:  # a layer that names its checkpoint tensors itself (experts)
            targets.update((checkpoint_name, Target(module, kind, part))
                           for checkpoint_name, (kind, part) in names(prefix).items())
            continue
        parts = getattr(module, "parts", ())
        for kind, param in module.named_parameters(recurse=False):
            if param is None:
                continue
            if parts:
                for index, part in enumerate(parts):
                    targets[f"{parent}.{part}.{kind}"] = Target(module, kind, index)
            else:
                targets[f"{prefix}{kind}"] = Target(module, kind)
        if isinstance(module, LinearBase) and getattr(module, "bias_in_checkpoint", False) \
                and module.bias is None:  # a row-parallel bias another rank adds
            targets[f"{prefix}bias"] = Target(module, "bias")
    return targets


def materialize(model: nn.Module, device: torch.device) -> None:
    """Real, uninitialized parameters on `device` in place of the meta ones."""
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                # torch.empty, not empty_like: a meta tensor's empty_like goes through torch._refs,
                # whose first use imports sympy (~0.6 s of every start)
                module._parameters[key] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=False)


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, CheckpointTensor]],
                 device: torch.device, elsewhere: frozenset[str] = frozenset()) -> None:
    """Every parameter of the model from the checkpoint's tensors, but those named in
    `elsewhere` (whose layers are about to be replaced: a GGUF's kept codes). A model whose
    checkpoint has no output projection ties it to the embedding (`lm_head = None`); under
    tensor parallelism a tied head is a vocabulary-parallel copy of the embedding's slice."""
    materialize(model, device)
    targets = checkpoint_targets(model)
    loaded = set(elsewhere)
    for name, tensor in tensors:
        if name == TIED_HEAD and model.lm_head is None:
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} belongs to no parameter of "
                             f"{type(model).__name__}")
        target.load(tensor)
        loaded.add(name)
    missing = sorted(set(targets) - loaded - {TIED_HEAD})
    if missing:
        raise ValueError(f"checkpoint is missing {missing}")
    if model.lm_head is not None and TIED_HEAD not in loaded:
        model.lm_head = None
        model.config.tie_word_embeddings = True
    _split_tied_head(model)


def _split_tied_head(model: nn.Module) -> None:
    embedding = model.model.embed_tokens
    if model.lm_head is not None or embedding.shard.size == 1:
        return
    with torch.device("meta"):
        head = ParallelLMHead(model.config.vocab_size, model.config.hidden_size,
                              embedding.weight.dtype)
    head.weight = nn.Parameter(embedding.weight.detach(), requires_grad=False)
    model.lm_head = head
