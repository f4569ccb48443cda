"""Tensors that live as long as the process (constants cached on first use): a kernel tape
(engine.executor.kernel_tape) may point into them, as into the model's own weights."""

from __future__ import annotations

import torch

_LIFELONG: list[torch.Tensor] = []


def lifelong(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, noted as never freed (the caller keeps it for the life of the process)."""
    _LIFELONG.append(tensor)
    return tensor


def lifelong_tensors() -> list[torch.Tensor]:
    return list(_LIFELONG)
