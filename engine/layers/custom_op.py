"""Layers with one implementation per kind of device, bound once at start-up.

A `CustomOp` has `forward_native` (torch ops: any device, and what torch.compile fuses by
itself) and may have `forward_cpu` (our C++ kernels). `use` binds one as the layer's
`forward` (engine.executor.kernel_choice decides which, once, for the whole model): no layer
asks on each call which implementation applies.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

Implementation = Literal["native", "cpu"]


class CustomOp(nn.Module):
    def forward(self, *args: Any) -> Any:
        return self.forward_native(*args)

    def forward_native(self, *args: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any) -> Any:
        return self.forward_native(*args)

    def use(self, implementation: Implementation) -> None:
        self.forward = self.forward_cpu if implementation == "cpu" else self.forward_native


def use_implementation(model: nn.Module, implementation: Implementation) -> int:
    """Binds every CustomOp of the model to `implementation`; returns how many."""
    ops = [module for module in model.modules() if isinstance(module, CustomOp)]
    for op in ops:
        op.use(implementation)
    return len(ops)
