"""The step's attention metadata and backend, set once around a forward pass.

Every attention layer of a step reads the same metadata. Threading it through each layer's
signature would also make it an input of the compiled graph, which it cannot be (it holds
Python lists and per-step plans), so the model runner sets it here for the length of one
forward and the attention layer (or its op, when compiled) reads it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class ForwardContext:
    metadata: AttentionMetadata
    backend: AttentionBackend


_current: ForwardContext | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata, backend: AttentionBackend) -> Iterator[None]:
    global _current
    previous, _current = _current, ForwardContext(metadata, backend)
    try:
        yield
    finally:
        _current = previous


def current_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward_context(metadata, backend)")
    return _current
