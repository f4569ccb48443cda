"""A KV block as bytes, for the places it goes beyond this engine's pool: the disk tier
(engine.kv_offload) and another engine (engine.kv_transfer). A payload is the block's K and
V in every layer, one after another; its layout key names what those bytes mean."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from common.config import EngineConfig
from engine.block_manager import BlockManager

KVCache = tuple[torch.Tensor, torch.Tensor]


def payload_layout(model: str, dtype: torch.dtype, block_size: int, caches: list[KVCache],
                   meaning: str) -> str:
    """Names what a payload means: the model, the dtype, the caches' shapes and (an 8-bit
    cache's) their codes and `meaning` (its key tables: ModelRunner.kv_meaning)."""
    name = Path(model.rstrip("/")).name or "model"
    shapes = [tuple(cache.shape[1:]) for layer in caches for cache in layer]
    codes = caches[0][0].dtype
    described = (str(Path(model).resolve()), str(dtype), block_size, shapes)
    if codes != dtype:
        described += (str(codes), meaning)
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8).hexdigest()
    return f"{name}-{str(dtype).removeprefix('torch.')}-b{block_size}-{digest}"


def why_blocks_stay(config: EngineConfig, block_manager: BlockManager) -> str | None:
    """Why this engine's blocks cannot leave it whole (for the disk tier or another engine),
    or None: they can with one KV cache group, one tensor-parallel rank, prefix caching."""
    if not block_manager.enable_prefix_caching:
        return "prefix caching is off"
    if any(group.window is not None for group in block_manager.groups):
        return "sliding-window layers drop blocks behind their window"
    if config.tensor_parallel_size > 1:
        return "tensor-parallel ranks each hold a share of the heads"
    return None


class BlockCopier:
    """A block's K and V in every layer as one payload of bytes, and back."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = [cache for layer in caches for cache in layer]  # K, V of each layer
        self.block_bytes = [cache[0].numel() * cache.element_size() for cache in self.caches]

    @property
    def payload_bytes(self) -> int:
        return sum(self.block_bytes)

    def read(self, block_ids: list[int]) -> bytes:
        """The blocks' payloads one after another (one gather per cache tensor)."""
        index = torch.tensor(block_ids, device=self.caches[0].device)
        rows = [cache.index_select(0, index).view(len(block_ids), -1).view(torch.uint8)
                for cache in self.caches]
        return torch.cat(rows, dim=1).cpu().numpy().tobytes()

    def write(self, block_id: int, payload: bytes | memoryview) -> bool:
        """False (nothing written) when the payload is not one block's size."""
        view = memoryview(payload)
        if view.nbytes != self.payload_bytes:
            return False
        data = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        data = data.to(self.caches[0].device)  # one copy to a GPU, then copies on it
        for cache, piece in zip(self.caches, data.split(self.block_bytes), strict=True):
            target = cache[block_id]
            target.copy_(piece.view(cache.dtype).view(target.shape))
        return True
