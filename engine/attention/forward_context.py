"""The step's attention metadata and backend, set once around a forward pass.

Every attention layer of a step reads the metadata of its KV cache group (one per group:
each group has its own block tables, engine.kv_cache_groups). Threading it through each layer's
signature would also make it an input of the compiled graph, which it cannot be (it holds
Python lists and per-step plans), so the model runner sets it here for the length of one
forward and the attention layer (or its op, when compiled) reads it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.attention.metadata import AttentionMetadata


class StepGaveWay(Exception):
    """A forward stopped midway because its caller asked it to give way (engine.give_way)."""


@dataclass(frozen=True, slots=True)
class ForwardContext:
    metadata_by_group: tuple[AttentionMetadata, ...]
    backend: AttentionBackend
    # Linear products multiply at least MIN_ROWS rows this step (engine.layers.batch_invariant)
    pad_products: bool = False
    # Asked before each attention layer: True stops the step there (engine.give_way)
    give_way: Callable[[], bool] | None = None

    def metadata(self, group: int = 0) -> AttentionMetadata:
        return self.metadata_by_group[group]


_current: ForwardContext | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata | Sequence[AttentionMetadata],
                    backend: AttentionBackend, pad_products: bool = False,
                    give_way: Callable[[], bool] | None = None) -> Iterator[None]:
    """`metadata`: the step's, or one per KV cache group; `pad_products`, `give_way`: see
    ForwardContext."""
    global _current
    by_group = tuple(metadata) if isinstance(metadata, Sequence) else (metadata,)
    previous, _current = _current, ForwardContext(by_group, backend, pad_products, give_way)
    try:
        yield
    finally:
        _current = previous


def current_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward_context(metadata, backend)")
    return _current


def pads_products() -> bool:
    """Whether this step's linear products multiply at least MIN_ROWS rows (False outside a
    step)."""
    return _current is not None and _current.pad_products
