"""`loom::linear`: a packed or quantized linear layer (or a routed-experts block, [T, hidden]
in and out) as one opaque op for torch.compile.

A oneDNN-packed weight or a quantized one (engine.quantization) is nothing torch can trace,
so a compiled model's such layers call themselves through this op (`trace_as_op`, bound once
at start-up): the graph keeps the eager path's GEMMs as they are and holds none of their
weights. Inductor then needs no freezing to reach those GEMMs' speed, and a graph without
frozen weights is one its FX graph cache can store, so a warm start loads it instead of
recompiling.

The op is registered with `torch.library.Library` rather than `custom_op`, whose dispatch
costs several times more per call (docs/benchmarks.md), and a decode step makes one per
linear layer.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

_layers: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_handles = itertools.count()

_library = torch.library.Library("loom", "FRAGMENT")
_library.define("linear(Tensor x, int handle) -> Tensor")


def trace_as_op(layer: nn.Module) -> None:
    """From now on `layer.forward` is `loom::linear` (held weakly: the model owns the layer),
    which runs the layer's own class forward inside."""
    handle = next(_handles)
    _layers[handle] = layer

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.loom.linear(x, handle)

    layer.forward = forward


def _run(x: torch.Tensor, handle: int) -> torch.Tensor:
    layer = _layers[handle]
    return type(layer).forward(layer, x)


def _shape(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _layers[handle].out_features)


_library.impl("linear", _run, "CompositeExplicitAutograd")
torch.library.register_fake("loom::linear", _shape, lib=_library)
