"""What every attention backend is: a builder of each step's metadata, a KV write and an
attention over the paged cache, for one device, dtype and model shape chosen at start-up
(engine.attention.selector).

The KV cache of one layer is a pair of tensors shaped
[num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a block). A step's
`forward` writes the step's new K/V through the slot mapping and attends each request's
queries over its whole context (cached blocks + the new tokens, causally).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.workspace import Workspace


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init__(self, block_size: int, num_kv_heads: int) -> None:
        """`num_kv_heads`: the KV heads of this process's cache (its share under tensor
        parallelism), which the step's plan is expanded for."""
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads

    def build_metadata(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
        slot_mapping: list[int], device: torch.device | str,
        workspace: Workspace | None = None, row_requests: frozenset[int] = frozenset(),
    ) -> AttentionMetadata:
        """The step's metadata, planned for this backend before the forward."""
        metadata = AttentionMetadata.build(query_lens, seq_lens, block_tables, slot_mapping,
                                           self.block_size, device, workspace, row_requests)
        self.plan(metadata)
        return metadata

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Everything every layer of the step reads, made once into `metadata`."""

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [T, num_kv_heads, head_dim] into their slots of the caches."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, num_heads, D], k and v [T, num_kv_heads, D] -> [T, num_heads, D]; with a
        `window`, each query attends to its last `window` tokens (itself included), as
        transformers' sliding-window layers do; with a `softcap`, every scaled score s
        becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
