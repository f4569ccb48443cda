"""Submodules and parameters as plain instance attributes, for the eager forward.

nn.Module keeps them in its `_modules` and `_parameters` dicts and finds them through
`__getattr__` on every read: a decode step of a 30-layer model reads ~380 of them, ~1.5 µs
each (a batch-1 step measured 0.3-1.0 ms faster pinned, four alternating rounds). Pinning
copies each into the instance `__dict__`, where attribute lookup finds it first. Assigning a
module or a Parameter through nn.Module drops the pinned copy (Module.__setattr__ clears the
name from `__dict__`), so later changes still land; buffers are not pinned (assigning one does
not clear it).
"""

from __future__ import annotations

import itertools

from torch import nn


def pin_attributes(model: nn.Module) -> None:
    for module in model.modules():
        for name, value in itertools.chain(module._modules.items(),
                                           module._parameters.items()):
            if value is not None:
                module.__dict__[name] = value
