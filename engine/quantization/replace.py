"""Putting the module that multiplies a linear's weight in the linear's place, keeping what
the layer's declaration adds around the product (engine.layers.linear: `wrap`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from engine.layers.linear import LinearBase

Product = TypeVar("Product", bound=nn.Module)


def replace_linears(model: nn.Module,
                    make: Callable[[torch.Tensor, torch.Tensor | None], Product],
                    ) -> list[Product]:
    """Replaces every float `nn.Linear` of the model (declared layers included) and every
    routed expert's projections by `make(weight, bias)`; a tied output projection
    (`lm_head is None`) gets one made from the embedding, which stays for the lookup.
    Returns the new modules."""
    made: list[Product] = []
    for parent in list(model.modules()):
        if hasattr(parent, "replace_products"):  # routed experts: one product per expert
            made.extend(parent.replace_products(make))
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                made.append(make(child.weight, child.bias))
                wrapped = child.wrap(made[-1]) if isinstance(child, LinearBase) else made[-1]
                setattr(parent, name, wrapped)
    if getattr(model, "lm_head", ()) is None:
        made.append(make(model.model.embed_tokens.weight, None))
        model.lm_head = made[-1]
    return made
