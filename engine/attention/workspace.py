"""Scratch buffers a step's attention (and the runner's logits) reuse across layers and steps."""

from __future__ import annotations

import torch


class Workspace:
    """Grow-only scratch buffers reused across layers and steps.

    Large temporaries get fresh pages from the OS on every allocation, so the
    gathered K/V live in persistent flat buffers handed out as views.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]


DEFAULT_WORKSPACE = Workspace()
