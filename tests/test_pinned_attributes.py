"""Pinned submodules and parameters (engine.layers.pinned_attributes)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.pinned_attributes import pin_attributes


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("offset", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale + self.offset


def test_pinned_names_are_plain_attributes_and_the_forward_is_unchanged() -> None:
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 3)
    want = model(x)
    pin_attributes(model)
    block = model[0]
    assert block.__dict__["inner"] is block._modules["inner"]
    assert block.__dict__["scale"] is block._parameters["scale"]
    assert "offset" not in block.__dict__  # buffers stay with nn.Module
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_assigning_a_module_or_parameter_after_pinning_still_lands() -> None:
    block = Block()
    pin_attributes(block)
    replacement = nn.Linear(3, 3)
    block.inner = replacement
    block.scale = nn.Parameter(torch.full((3,), 2.0))
    block.offset = torch.ones(3)
    assert block.inner is replacement and block._modules["inner"] is replacement
    assert torch.equal(block.scale, torch.full((3,), 2.0))
    x = torch.randn(2, 3)
    torch.testing.assert_close(block(x), replacement(x) * 2 + 1)
