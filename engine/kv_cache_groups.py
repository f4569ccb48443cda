"""How the layers share the KV cache: groups of layers with one block table each.

A model whose layers all attend alike (Llama, or Mistral where every layer slides) is one
group: one block table per request, each block id naming a block in every layer. A model
that mixes sliding-window and global layers (Gemma 2 and 3) splits its layers into groups of
one kind, all groups the same number of layers, and each request keeps one block table per
group. Every block id of the shared pool then costs the same bytes whichever group takes
it, and a sliding group's table drops the blocks behind its window, which go back to the
pool (vLLM's hybrid KV cache manager has the same shape). Pure Python: the block manager
and the model runner both read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a torch-free module: the config is only a type here
    from engine.models.config import ModelConfig


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    layers: tuple[int, ...]
    window: int | None  # the sliding window of its layers; None: they attend to everything

    def first_live_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block the request's next query (at position num_computed_tokens) reads:
        a sliding layer's query at p sees keys from p - window + 1 on."""
        if self.window is None:
            return 0
        return max(0, (num_computed_tokens - self.window + 1) // block_size)

    def max_live_blocks(self, num_tokens: int, max_chunk: int, block_size: int) -> int:
        """The most blocks a request of num_tokens holds in this group at once, its chunks
        at most max_chunk tokens long."""
        whole = blocks_for(num_tokens, block_size)
        if self.window is None:
            return whole
        return min(whole, blocks_for(self.window - 1, block_size) + 1
                   + blocks_for(max_chunk, block_size))


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVCacheLayout:
        return cls((KVCacheGroup(tuple(range(num_layers)), window),))

    @classmethod
    def for_model(cls, config: ModelConfig, hybrid: bool = True) -> KVCacheLayout:
        return cls.for_windows(config.layer_windows or (None,) * config.num_hidden_layers,
                               hybrid)

    @classmethod
    def for_windows(cls, layer_windows: list[int | None] | tuple[int | None, ...],
                    hybrid: bool = True) -> KVCacheLayout:
        """Layers of one window (or of none) together. Without `hybrid`, or when every layer
        has the same window, one group: a mixed model then keeps every block of every layer
        as long as the request lives."""
        kinds = list(dict.fromkeys(layer_windows))
        if len(kinds) == 1:
            return cls.single(len(layer_windows), kinds[0])
        if not hybrid:
            return cls.single(len(layer_windows))
        by_kind = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
        size = min(len(layers) for layers in by_kind.values())
        return cls(tuple(KVCacheGroup(tuple(layers[start:start + size]), kind)
                         for kind, layers in by_kind.items()
                         for start in range(0, len(layers), size)))

    @property
    def group_size(self) -> int:
        """Layers per group: the KV tensors one block id addresses."""
        return max(len(group.layers) for group in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer: it reads its group's block table and the slot-th of
        the group_size cache tensors."""
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")

    def describe(self) -> str:
        if self.num_groups == 1:
            window = self.groups[0].window
            return "one group" + (f", sliding window {window}" if window else "")
        parts = [f"{sum(g.window == kind for g in self.groups)} "
                 + ("full" if kind is None else f"sliding({kind})")
                 for kind in dict.fromkeys(self.windows)]
        return f"{' + '.join(parts)} groups of {self.group_size} layers"
