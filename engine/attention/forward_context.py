"""The step's attention metadata, set once around a forward pass.

Every attention layer of a step reads the same metadata. Threading it through each layer's
signature would also make it an input of the compiled graph, which it cannot be (it holds
Python lists and per-step plans), so the model runner sets it here for the length of one
forward and the attention op reads it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.attention.metadata import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside a forward_context(metadata)")
    return _current
