"""KV cache block manager: fixed-size blocks, per-request block tables, prefix caching.

Pure Python (no torch): it hands out block ids; the model runner owns the tensors.

Every full block is identified by a hash of (its parent block's hash, its token ids), so a
new request whose prompt starts with cached blocks reuses them and prefills only the rest.
Blocks are reference counted. A block whose count drops to zero joins the free queue but
keeps its cached contents until it is reused: the queue front is evicted first, so the
queue order is LRU, and a request's blocks are queued tail first so that the end of a
chain is evicted before its parents. Allocation and a cache hit are O(1) per block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.request import Request

ROOT_HASH = b""


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block(parent_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(b",".join(str(token).encode() for token in token_ids))
    return digest.digest()


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full, computed and cached
    parent_hash: bytes = ROOT_HASH
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of which found in the cache


@dataclass(slots=True)
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    free_queue: OrderedDict[int, None] = field(init=False)  # ref 0; the front is evicted first
    cached: dict[bytes, int] = field(init=False)  # block hash -> block id
    inflight: dict[bytes, int] = field(init=False)  # hashes being computed -> block id
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_integrity_violations: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(block_id) for block_id in range(self.num_blocks)]
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        self.cached = {}
        self.inflight = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: free ones and cached ones nobody uses."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # --- hashing ---------------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < request.num_tokens // size:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, tuple(request.token_ids[start:start + size])))
        return hashes

    def cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached chain the request's tokens start with, leaving at
        least its last token to compute (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def next_block_inflight(self, request: Request, num_hit_blocks: int) -> bool:
        """Is the block after the request's cached prefix being computed by a running request?
        Then waiting one step turns that work into a cache hit instead of a recompute."""
        if not self.enable_prefix_caching:
            return False
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        return num_hit_blocks < min(len(hashes), max_blocks) and \
            hashes[num_hit_blocks] in self.inflight

    # --- allocation ------------------------------------------------------------------------
    def num_missing_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks the request still needs so its table covers its first num_tokens tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(request.block_table))

    def can_allocate(self, request: Request, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Can the request (after taking `prefix`, its cached blocks) cover num_tokens?"""
        reused_free = sum(1 for block_id in prefix if self.blocks[block_id].ref_count == 0)
        missing = max(0, blocks_for(num_tokens, self.block_size)
                      - len(request.block_table) - len(prefix))
        return missing + reused_free <= self.num_free_blocks

    def take_prefix(self, request: Request, prefix: list[int]) -> None:
        """Admission: the request starts from its cached prefix blocks."""
        assert not request.block_table, "only a request without blocks takes a prefix"
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        request.block_table = list(prefix)
        request.num_computed_tokens = len(prefix) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += request.num_computed_tokens

    def allocate(self, request: Request, num_tokens: int) -> None:
        missing = self.num_missing_blocks(request, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"{request.request_id}: {missing} blocks needed, "
                               f"{self.num_free_blocks} free")
        hashes = self.block_hashes(request) if self.enable_prefix_caching else []
        for _ in range(missing):
            block = self._pop_free_block()
            block.ref_count = 1
            index = len(request.block_table)
            request.block_table.append(block.block_id)
            if index < len(hashes):
                self.inflight.setdefault(hashes[index], block.block_id)

    def _pop_free_block(self) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached contents
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        return block

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for index in range(num_full - 1, -1, -1):  # walk back to the last cached block
            block = self.blocks[request.block_table[index]]
            if block.block_hash is not None:
                break
            start = index * self.block_size
            block.block_hash = hashes[index]
            block.parent_hash = hashes[index - 1] if index else ROOT_HASH
            block.token_ids = tuple(request.token_ids[start:start + self.block_size])
            self.cached.setdefault(block.block_hash, block.block_id)
            if self.inflight.get(block.block_hash) == block.block_id:
                del self.inflight[block.block_hash]

    def free(self, request: Request) -> None:
        # Tail first: the end of a chain is evicted before its parents.
        hashes = request.block_hashes
        for index in range(len(request.block_table) - 1, -1, -1):
            block = self.blocks[request.block_table[index]]
            block.ref_count -= 1
            if index < len(hashes) and self.inflight.get(hashes[index]) == block.block_id:
                del self.inflight[hashes[index]]
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                if block.block_hash is None:  # nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block.block_id, last=False)
        request.block_table = []

    # --- integrity -------------------------------------------------------------------------
    def check_integrity(self, live_requests: list[Request]) -> list[str]:
        """Each block is free (maybe cached) or owned by exactly ref_count live-request table
        entries; every cached hash names a block holding exactly those tokens."""
        problems: list[str] = []
        owners: dict[int, int] = {}
        for request in live_requests:
            hashes = request.block_hashes
            for index, block_id in enumerate(request.block_table):
                owners[block_id] = owners.get(block_id, 0) + 1
                block = self.blocks[block_id]
                if block.block_hash is not None and (index >= len(hashes)
                                                     or hashes[index] != block.block_hash):
                    problems.append(f"block {block_id} of {request.request_id} holds other "
                                    f"tokens than its table position {index} expects")
        for block in self.blocks:
            in_free_queue = block.block_id in self.free_queue
            owned = owners.get(block.block_id, 0)
            if in_free_queue == (block.ref_count > 0) or owned != block.ref_count:
                problems.append(f"block {block.block_id}: ref count {block.ref_count}, "
                                f"{owned} live owners, in free queue: {in_free_queue}")
        for block_hash, block_id in self.cached.items():
            block = self.blocks[block_id]
            if block.block_hash != block_hash or hash_block(
                    block.parent_hash, block.token_ids) != block_hash:
                problems.append(f"cached hash of block {block_id} does not match its tokens")
        self.num_integrity_violations += len(problems)
        return problems
