"""The engine's side of the disk tier: a block's K and V in every layer as one payload.

`save` copies a block the step has just computed and cached out of the cache tensors (a
memcpy; the disk write happens on the store's thread); `load` copies a payload back into a
free block. The block manager calls both (engine.block_manager: write-through on caching,
promotion on a prefix lookup). Full-attention layers only: where sliding-window layers drop
the blocks behind their window (Gemma 2 and 3, Mistral) the tier stays off, for now."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from common.config import EngineConfig
from common.default_model import default_cache_dir
from engine.block_manager import BlockManager
from engine.kv_blocks import BlockCopier, KVCache, payload_layout, why_blocks_stay
from engine.kv_offload.disk_store import DiskKVStore

logger = logging.getLogger(__name__)

class DiskTier:
    def __init__(self, store: DiskKVStore, caches: list[KVCache]) -> None:
        self.store = store
        self.copier = BlockCopier(caches)

    def save(self, block_id: int, block_hash: bytes) -> None:
        """Called on the step loop: no disk access here (the writer thread checks whether
        another engine wrote the block already)."""
        if not self.store.indexed(block_hash):
            self.store.put(block_hash, self.copier.read([block_id]))

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.store

    def load(self, block_id: int, block_hash: bytes) -> str | None:
        """The block's K and V from disk into `block_id`; None (nothing written) if the
        store has no whole copy of it."""
        payload = self.store.get(block_hash)
        return "disk" if payload is not None and self.copier.write(block_id, payload) else None

    def close(self) -> None:
        self.store.flush()
        self.store.close()

    def as_stats(self) -> dict[str, int | float]:
        """As common.protocol.StepStats names them (the tokens it supplied come from the
        block manager)."""
        stats = self.store.stats
        return {"kv_offload_read_bytes_total": stats.bytes_read,
                "kv_offload_written_bytes_total": stats.bytes_written,
                "kv_offload_read_seconds_total": stats.read_seconds,
                "kv_offload_write_seconds_total": stats.write_seconds}


def attach_disk_tier(config: EngineConfig, block_manager: BlockManager, caches: list[KVCache],
                     dtype: torch.dtype, meaning: str) -> DiskTier | None:
    """The disk tier under the block manager's pool, where the config asks for one and this
    engine can keep it (one KV cache group, one tensor-parallel rank, prefix caching on)."""
    if not config.kv_offload_bytes:
        return None
    why_not = why_blocks_stay(config, block_manager)
    if why_not is not None:
        logger.warning("KV disk tier off: %s", why_not)
        return None
    directory = Path(config.kv_offload_dir or default_cache_dir() / "kv")
    key = payload_layout(config.model, dtype, config.block_size, caches, meaning)
    tier = DiskTier(DiskKVStore(directory, key, config.kv_offload_bytes), caches)
    block_manager.tier = tier
    logger.info("KV disk tier: %s, %d blocks (%.2f GiB of %.2f) from earlier runs",
                tier.store.directory, len(tier.store), tier.store.num_bytes / 2**30,
                config.kv_offload_bytes / 2**30)
    return tier
