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

from common.protocol import KVBlocks
from engine.block_manager import BlockManager, BlockTier
from engine.request import Request

logger = logging.getLogger("loom.engine")

KVCache = tuple[torch.Tensor, torch.Tensor]
# Received blocks held for requests not yet admitted, beyond which the oldest are dropped.
DEFAULT_STAGED_BYTES = 1 << 30


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


@dataclass(slots=True)
class KVExporter:
    copier: BlockCopier
    layout: str
    block_manager: BlockManager
    sent: dict[str, int] = field(default_factory=dict)  # request id -> blocks sent so far
    requests: dict[str, Request] = field(default_factory=dict)

    def add(self, request: Request, skip_blocks: int = 0) -> None:
        """Exports the request's prompt blocks after the first `skip_blocks`."""
        self.requests[request.request_id] = request
        self.sent[request.request_id] = skip_blocks

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.sent.pop(request_id, None)

    def collect(self) -> list[tuple[KVBlocks, bytes]]:
        """Each exporting request's prompt blocks cached since the last call; a finished or
        aborted request's last ones, and then it is forgotten."""
        messages = []
        for request_id, request in list(self.requests.items()):
            message = self._new_blocks(request)
            if message is not None:
                messages.append(message)
            if request.is_finished:
                del self.requests[request_id], self.sent[request_id]
        return messages

    def _new_blocks(self, request: Request) -> tuple[KVBlocks, bytes] | None:
        manager = self.block_manager
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        hashes = manager.block_hashes(request)[:computed // manager.block_size]
        first = self.sent[request.request_id]
        cached = manager.cached[0]
        ready = []
        for block_hash in hashes[first:]:
            block_id = cached.get(block_hash)  # committed blocks are cached, whoever made them
            if block_id is None:
                break
            ready.append((block_hash, block_id))
        if not ready:
            return None
        self.sent[request.request_id] = first + len(ready)
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
