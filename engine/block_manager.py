"""KV cache block manager: fixed-size blocks, per-request block tables, prefix caching.

Pure Python (no torch): it hands out block ids; the model runner owns the tensors. A request
holds one block table per KV cache group (engine.kv_cache_groups); all groups draw from one
pool. A sliding-window group's table gives the blocks behind its window back as soon as no
query can read them, leaving the null block (never handed out) in their place.

Every full block is identified by a hash of (its parent block's hash, its token ids), so a
new request whose prompt starts with cached blocks reuses them and prefills only the rest.
Blocks are reference counted. A block whose count drops to zero joins the free queue but
keeps its cached contents until it is reused: the queue front is evicted first, so the
queue order is LRU, and a request's blocks are queued tail first so that the end of a
chain is evicted before its parents. Allocation and a cache hit are O(1) per block.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv_cache_groups import KVCacheGroup, blocks_for
from engine.request import Request

ROOT_HASH = b""
FULL_ATTENTION = (KVCacheGroup((), None),)


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
    group: int = 0  # the KV cache group whose table holds it


@dataclass(slots=True)
class CachedPrefix:
    """The leading blocks of a request's tokens found in the cache, as each group's table
    starts (the null block where a sliding group no longer needs one)."""

    num_blocks: int
    tables: list[list[int]]


class BlockTier(Protocol):
    """A lower tier of the prefix cache (engine.kv_offload, engine.kv_transfer): cached
    blocks are saved to it, and a lookup promotes the blocks it holds back into free blocks
    of the pool."""

    def save(self, block_id: int, block_hash: bytes) -> None: ...

    def has(self, block_hash: bytes) -> bool: ...

    def load(self, block_id: int, block_hash: bytes) -> str | None:
        """Writes the block into `block_id`; returns the name of the tier that held it
        ("disk", "transfer"), or None when none had a whole copy (nothing written)."""
        ...


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of which found in the cache
    # of which lower tiers supplied, by tier (promoted into the pool first)
    tier_hits: Counter[str] = field(default_factory=Counter)

    @property
    def disk_hits(self) -> int:
        return self.tier_hits["disk"]

    @property
    def transfer_hits(self) -> int:
        return self.tier_hits["transfer"]


@dataclass(slots=True)
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    groups: tuple[KVCacheGroup, ...] = FULL_ATTENTION
    blocks: list[Block] = field(init=False)
    free_queue: OrderedDict[int, None] = field(init=False)  # ref 0; the front is evicted first
    cached: list[dict[bytes, int]] = field(init=False)  # per group: block hash -> block id
    inflight: list[dict[bytes, int]] = field(init=False)  # per group: hashes being computed
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_integrity_violations: int = 0
    tier: BlockTier | None = None  # one KV cache group only

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(block_id) for block_id in range(self.num_blocks)]
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        self.cached = [{} for _ in self.groups]
        self.inflight = [{} for _ in self.groups]

    @property
    def null_block(self) -> int:
        """Stands in a table for a block behind a window: the runner's one extra block,
        read only under the window's mask."""
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: free ones and cached ones nobody uses."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens holds at once, over all its tables."""
        return sum(group.max_live_blocks(num_tokens, max_chunk, self.block_size)
                   for group in self.groups)

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

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest prefix of whole blocks every group has cached (a sliding group only
        its window before the prefix's end), leaving at least the request's last token to
        compute (its logits are needed)."""
        no_hit = CachedPrefix(0, [[] for _ in self.groups])
        if not self.enable_prefix_caching or request.sampling.pooling == "mean":
            return no_hit  # a mean pools every prompt token's state: none may be skipped
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        count = len(hashes)
        for cached, group in zip(self.cached, self.groups, strict=True):
            if group.window is None:
                count = next((i for i, h in enumerate(hashes[:count]) if h not in cached), count)
        while count > 0 and not self._windows_cached(hashes, count):
            count -= 1
        if self.tier is not None:
            count = self._promote(request, hashes, count)
        if count == 0:
            return no_hit
        return CachedPrefix(count, [self._hit_table(g, hashes, count)
                                    for g in range(len(self.groups))])

    def _promote(self, request: Request, hashes: list[bytes], count: int) -> int:
        """The tier's blocks that continue the pool's hit (`count` blocks) loaded into free
        blocks (never one of the hit's own) and cached; returns the hit's new length."""
        assert self.tier is not None
        hit = {self.cached[0][h] for h in hashes[:count]}
        parent = hashes[count - 1] if count else ROOT_HASH
        while count < len(hashes) and self.tier.has(hashes[count]):
            spare = next((b for b in self.free_queue if b not in hit), None)
            if spare is None:
                break
            block = self._pop_free_block(spare)
            self.free_queue[spare] = None  # free still, and the most recently used
            source = self.tier.load(spare, hashes[count])
            if source is None:
                self.free_queue.move_to_end(spare, last=False)
                break
            block.block_hash, block.parent_hash, block.group = hashes[count], parent, 0
            start = count * self.block_size
            block.token_ids = tuple(request.token_ids[start:start + self.block_size])
            self.cached[0][block.block_hash] = spare
            self.stats.tier_hits[source] += self.block_size
            hit.add(spare)
            parent = hashes[count]
            count += 1
        return count

    def _windows_cached(self, hashes: list[bytes], count: int) -> bool:
        for cached, group in zip(self.cached, self.groups, strict=True):
            first = group.first_live_block(count * self.block_size, self.block_size)
            if group.window is not None and any(
                    h not in cached for h in reversed(hashes[first:count])):
                return False
        return True

    def _hit_table(self, group: int, hashes: list[bytes], count: int) -> list[int]:
        first = self.groups[group].first_live_block(count * self.block_size, self.block_size)
        cached = self.cached[group]
        return [self.null_block] * first + [cached[h] for h in hashes[first:count]]

    def next_block_inflight(self, request: Request, num_hit_blocks: int) -> bool:
        """Is the block after the request's cached prefix being computed by a running request?
        Then waiting one step turns that work into a cache hit instead of a recompute."""
        if not self.enable_prefix_caching:
            return False
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        return num_hit_blocks < min(len(hashes), max_blocks) and \
            hashes[num_hit_blocks] in self.inflight[0]

    # --- allocation ------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_tokens: int,
                     prefix: CachedPrefix | None = None) -> bool:
        """Can the request (after taking `prefix`, its cached blocks) cover num_tokens?"""
        tables = prefix.tables if prefix is not None else (
            request.block_tables or [[] for _ in self.groups])
        reused_free = 0 if prefix is None else sum(
            1 for table in prefix.tables for block_id in table
            if block_id != self.null_block and self.blocks[block_id].ref_count == 0)
        needed = blocks_for(num_tokens, self.block_size)
        missing = sum(max(0, needed - len(table)) for table in tables)
        return missing + reused_free <= self.num_free_blocks

    def take_prefix(self, request: Request, prefix: CachedPrefix) -> None:
        """Admission: the request starts from its cached prefix blocks."""
        assert not any(request.block_tables), "only a request without blocks takes a prefix"
        for table in prefix.tables:
            for block_id in table:
                if block_id != self.null_block:
                    self._take(self.blocks[block_id])
        request.block_tables = [list(table) for table in prefix.tables]
        request.num_computed_tokens = prefix.num_blocks * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += request.num_computed_tokens

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1

    def allocate(self, request: Request, num_tokens: int) -> None:
        if not self.can_allocate(request, num_tokens):
            raise RuntimeError(f"{request.request_id}: too few free blocks for {num_tokens} "
                               f"tokens ({self.num_free_blocks} free)")
        hashes = self.block_hashes(request) if self.enable_prefix_caching else []
        needed = blocks_for(num_tokens, self.block_size)
        if not request.block_tables:
            request.block_tables = [[] for _ in self.groups]
        for group, table in enumerate(request.block_tables):
            for index in range(len(table), needed):
                block = self._pop_free_block()
                block.ref_count, block.group = 1, group
                table.append(block.block_id)
                if index < len(hashes):
                    self.inflight[group].setdefault(hashes[index], block.block_id)

    def _pop_free_block(self, block_id: int | None = None) -> Block:
        """The front of the free queue (or `block_id`), its cached contents evicted."""
        if block_id is None:
            block_id, _ = self.free_queue.popitem(last=False)
        else:
            del self.free_queue[block_id]
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached contents
            cached = self.cached[block.group]
            if cached.get(block.block_hash) == block_id:
                del cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        return block

    def commit(self, request: Request) -> None:
        """After a step advanced the request: its full, computed blocks join the prefix
        cache, and blocks behind a sliding window go back to the pool."""
        if self.enable_prefix_caching:
            hashes = self.block_hashes(request)
            for group in range(len(self.groups)):
                self._cache_computed(request, group, hashes)
        for group, spec in enumerate(self.groups):
            first = spec.first_live_block(request.num_computed_tokens, self.block_size)
            table = request.block_tables[group]
            for index in range(min(first, len(table)) - 1, -1, -1):
                if table[index] == self.null_block:
                    break
                self._release(request, group, index)
                table[index] = self.null_block

    def _cache_computed(self, request: Request, group: int, hashes: list[bytes]) -> None:
        table = request.block_tables[group]
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for index in range(num_full - 1, -1, -1):  # walk back to the last cached block
            if table[index] == self.null_block:
                break
            block = self.blocks[table[index]]
            if block.block_hash is not None:
                break
            start = index * self.block_size
            block.block_hash = hashes[index]
            block.parent_hash = hashes[index - 1] if index else ROOT_HASH
            block.token_ids = tuple(request.token_ids[start:start + self.block_size])
            if self.cached[group].setdefault(block.block_hash, block.block_id) == \
                    block.block_id and self.tier is not None:
                self.tier.save(block.block_id, block.block_hash)  # write-through
            if self.inflight[group].get(block.block_hash) == block.block_id:
                del self.inflight[group][block.block_hash]

    def release_beyond(self, request: Request, num_tokens: int) -> None:
        """Gives back the blocks past the first num_tokens' (slots of rejected drafts)."""
        needed = blocks_for(num_tokens, self.block_size)
        for group, table in enumerate(request.block_tables):
            for index in range(len(table) - 1, needed - 1, -1):
                self._release(request, group, index)
                table.pop()

    def free(self, request: Request) -> None:
        # Tail first: the end of a chain is evicted before its parents.
        for group, table in enumerate(request.block_tables):
            for index in range(len(table) - 1, -1, -1):
                if table[index] != self.null_block:
                    self._release(request, group, index)
        request.block_tables = []

    def _release(self, request: Request, group: int, index: int) -> None:
        block = self.blocks[request.block_tables[group][index]]
        block.ref_count -= 1
        hashes, inflight = request.block_hashes, self.inflight[group]
        if index < len(hashes) and inflight.get(hashes[index]) == block.block_id:
            del inflight[hashes[index]]
        if block.ref_count == 0:
            self.free_queue[block.block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                self.free_queue.move_to_end(block.block_id, last=False)

    # --- integrity -------------------------------------------------------------------------
    def check_integrity(self, live_requests: list[Request]) -> list[str]:
        """Each block is free (maybe cached) or owned by exactly ref_count live-request table
        entries of its group; every cached hash names a block holding exactly those tokens."""
        problems: list[str] = []
        owners: dict[int, int] = {}
        for request in live_requests:
            hashes = request.block_hashes
            for group, table in enumerate(request.block_tables):
                for index, block_id in enumerate(table):
                    if block_id == self.null_block:
                        continue
                    owners[block_id] = owners.get(block_id, 0) + 1
                    block = self.blocks[block_id]
                    if block.group != group:
                        problems.append(f"block {block_id} of group {block.group} sits in a "
                                        f"table of group {group} ({request.request_id})")
                    if block.block_hash is not None and (index >= len(hashes)
                                                         or hashes[index] != block.block_hash):
                        problems.append(f"block {block_id} of {request.request_id} holds "
                                        f"other tokens than its table position {index} expects")
        for block in self.blocks:
            in_free_queue = block.block_id in self.free_queue
            owned = owners.get(block.block_id, 0)
            if in_free_queue == (block.ref_count > 0) or owned != block.ref_count:
                problems.append(f"block {block.block_id}: ref count {block.ref_count}, "
                                f"{owned} live owners, in free queue: {in_free_queue}")
        for group, cached in enumerate(self.cached):
            for block_hash, block_id in cached.items():
                block = self.blocks[block_id]
                if block.group != group or block.block_hash != block_hash or hash_block(
                        block.parent_hash, block.token_ids) != block_hash:
                    problems.append(f"cached hash of block {block_id} does not match its tokens")
        self.num_integrity_violations += len(problems)
        return problems
