"""KV handed from a prefill engine to a decode engine (prefill/decode disaggregation).

The prefill side (`KVExporter`): a request added with `export_kv` has its prompt's whole
blocks sent out as they are computed (or found in its prefix cache): after each step, the
blocks it has cached since the last one, as one KV_BLOCKS message (common.protocol) whose
payload is each block's K and V in every layer. The frontend relays them to the decode
engine it chose, then adds the request there after its first token.

The decode side (`ReceivedKV`): a lower tier of the prefix cache (engine.block_manager's
BlockTier). Received blocks wait here, addressed by their chained hash, until the request's
admission looks its prompt up: the block manager promotes them into free pool blocks and
caches them, as it does the disk tier's, so the request prefills only what was not sent.
A block the pool already caches is not kept. Blocks nobody claims go when their request
ends or is aborted, and the oldest go first beyond a byte cap: a miss recomputes, never
wrong output.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from common.config import EngineConfig
from common.protocol import AddRequest, KVBlocks
from engine.block_manager import BlockManager, BlockTier
from engine.kv_blocks import BlockCopier, KVCache, payload_layout, why_blocks_stay
from engine.request import Request

logger = logging.getLogger("loom.engine")

# Received blocks held for requests not yet admitted, beyond which the oldest are dropped.
DEFAULT_STAGED_BYTES = 1 << 30


@dataclass(slots=True)
class Export:
    request: Request
    num_sent: int  # its leading prompt blocks sent (or skipped) so far


@dataclass(slots=True)
class KVExporter:
    copier: BlockCopier
    layout: str
    block_manager: BlockManager
    exports: dict[str, Export] = field(default_factory=dict)

    def add(self, request: Request, skip_blocks: int = 0) -> None:
        """Exports the request's prompt blocks after the first `skip_blocks`."""
        self.exports[request.request_id] = Export(request, skip_blocks)

    def forget(self, request_id: str) -> None:
        self.exports.pop(request_id, None)

    def collect(self) -> list[tuple[KVBlocks, bytes]]:
        """Each exporting request's prompt blocks cached since the last call; a finished or
        aborted request's last ones, and then it is forgotten."""
        messages = []
        for request_id, export in list(self.exports.items()):
            message = self._new_blocks(export)
            if message is not None:
                messages.append(message)
            if export.request.is_finished:
                del self.exports[request_id]
        return messages

    def _new_blocks(self, export: Export) -> tuple[KVBlocks, bytes] | None:
        manager, request = self.block_manager, export.request
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        hashes = manager.block_hashes(request)[:computed // manager.block_size]
        cached = manager.cached[0]
        ready = []
        for block_hash in hashes[export.num_sent:]:
            block_id = cached.get(block_hash)  # committed blocks are cached, whoever made them
            if block_id is None:
                break
            ready.append((block_hash, block_id))
        if not ready:
            return None
        export.num_sent += len(ready)
        payload = self.copier.read([block_id for _, block_id in ready])
        return KVBlocks(request.request_id, self.layout, [h for h, _ in ready]), payload


@dataclass(slots=True)
class ReceivedKV:
    """Implements BlockTier; `below` is the tier under it (the disk tier), if any."""

    copier: BlockCopier
    layout: str
    block_manager: BlockManager
    below: BlockTier | None = None
    max_bytes: int = DEFAULT_STAGED_BYTES
    staged: OrderedDict[bytes, tuple[str, memoryview]] = field(default_factory=OrderedDict)
    num_bytes: int = 0
    num_dropped: int = 0  # frames refused (another layout, a torn payload)

    def receive(self, message: KVBlocks, payload: memoryview) -> bool:
        """Stages the frame's blocks; False (nothing kept) when it does not fit this cache."""
        size = self.copier.payload_bytes
        if message.layout != self.layout or len(payload) != size * len(message.block_hashes):
            self.num_dropped += 1
            logger.warning("dropped KV blocks for %s: layout %s, %d bytes for %d blocks "
                           "(this engine: %s, %d bytes a block)", message.request_id,
                           message.layout, len(payload), len(message.block_hashes),
                           self.layout, size)
            return False
        cached = self.block_manager.cached[0]
        for index, block_hash in enumerate(message.block_hashes):
            if block_hash in cached or block_hash in self.staged:
                continue
            self.staged[block_hash] = (message.request_id,
                                       payload[index * size:(index + 1) * size])
            self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            self._pop(next(iter(self.staged)))
        return True

    def drop(self, request_id: str) -> None:
        """The request ended (or will never come): its unclaimed blocks go."""
        for block_hash in [h for h, (owner, _) in self.staged.items() if owner == request_id]:
            self._pop(block_hash)

    def _pop(self, block_hash: bytes) -> memoryview:
        _, payload = self.staged.pop(block_hash)
        self.num_bytes -= len(payload)
        return payload

    def save(self, block_id: int, block_hash: bytes) -> None:
        if self.below is not None:
            self.below.save(block_id, block_hash)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.staged or (self.below is not None
                                             and self.below.has(block_hash))

    def load(self, block_id: int, block_hash: bytes) -> str | None:
        if block_hash in self.staged:
            return "transfer" if self.copier.write(block_id, self._pop(block_hash)) else None
        return None if self.below is None else self.below.load(block_id, block_hash)


@dataclass(slots=True)
class KVTransfer:
    """Both sides in one engine; with neither (`off`), requests export nothing and received
    blocks are dropped."""

    exporter: KVExporter | None = None
    received: ReceivedKV | None = None

    def add(self, request: Request, message: AddRequest) -> None:
        """A request just added: it exports its blocks if its ADD asks."""
        if message.export_kv and self.exporter is not None:
            self.exporter.add(request, message.kv_skip_blocks)

    def receive(self, message: KVBlocks, payload: memoryview) -> None:
        """A prefill engine's blocks for a request about to be added here."""
        if self.received is None:
            logger.warning("dropped KV blocks for %s: this engine takes none",
                           message.request_id)
        else:
            self.received.receive(message, payload)

    def collect(self) -> list[tuple[KVBlocks, bytes]]:
        """The prompt blocks exporting requests have cached since the last call."""
        return [] if self.exporter is None else self.exporter.collect()

    def finished(self, request_id: str) -> None:
        """Its blocks nobody claimed go; an export still sends its last ones (`collect`)."""
        if self.received is not None:
            self.received.drop(request_id)

    def aborted(self, request_id: str) -> None:
        """Nothing more goes out for it (and its decode leg, if it never came, leaves)."""
        self.finished(request_id)
        if self.exporter is not None:
            self.exporter.forget(request_id)


def attach_kv_transfer(config: EngineConfig, block_manager: BlockManager,
                       caches: list[KVCache], dtype: torch.dtype, meaning: str,
                       has_draft_model: bool) -> KVTransfer:
    """Both sides of handing a prompt's KV to another engine, where its blocks can travel
    whole (the received blocks as a tier above the disk tier); elsewhere a decode leg
    recomputes the prompt."""
    why_not = why_blocks_stay(config, block_manager) or (
        "a draft model's KV does not travel" if has_draft_model else None)
    if why_not is not None:
        logger.info("KV transfer (prefill/decode roles) off: %s", why_not)
        return KVTransfer()
    copier = BlockCopier(caches)
    layout = payload_layout(config.model, dtype, config.block_size, caches, meaning)
    received = ReceivedKV(copier, layout, block_manager, below=block_manager.tier)
    block_manager.tier = received
    return KVTransfer(KVExporter(copier, layout, block_manager), received)
