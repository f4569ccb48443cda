"""Which engine (data-parallel rank) serves a request.

- `cache_aware` (default): a request whose first prompt blocks an engine already holds goes
  there, unless that engine is overloaded against the least loaded one; otherwise the least
  loaded engine takes it. The frontend remembers, per prompt prefix of whole KV blocks,
  which engines were sent it (SGLang's cache-aware router keeps a radix tree of the text;
  chained block hashes are the same idea at the engine's own granularity).
- `load`: the least loaded engine.
- `round_robin`: each engine in turn (the baseline the other two are measured against).

Load is what vLLM's coordinator scores: waiting requests weigh 4, running ones 1. The
frontend knows its own in-flight count per engine at once, and the waiting share from the
engine's latest stats.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROUTING_POLICIES = ("cache_aware", "load", "round_robin")
# Prompt blocks hashed per request: affinity on longer prefixes adds nothing.
MAX_PREFIX_BLOCKS = 64
# Prefix entries remembered (least recently routed dropped first).
PREFIX_CAPACITY = 200_000
# The prefix holder keeps a request while its load stays within this of the least loaded
# engine's: max(OVERLOAD_SLACK, OVERLOAD_RATIO * least).
OVERLOAD_SLACK = 8
OVERLOAD_RATIO = 0.5


def prefix_hashes(prompt: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's whole blocks: entry k stands for blocks 0..k."""
    hashes: list[int] = []
    parent = 0
    full = min(len(prompt) // block_size, MAX_PREFIX_BLOCKS)
    for start in range(0, full * block_size, block_size):
        parent = hash((parent, tuple(prompt[start:start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class PrefixIndex:
    """Prefix hash -> bit set of the engines that were sent it, in LRU order."""

    capacity: int = PREFIX_CAPACITY
    holders: OrderedDict[int, int] = field(default_factory=OrderedDict)

    def longest_held(self, hashes: list[int], eligible: int) -> int:
        """The engines (bit set) among `eligible` holding the longest prefix any holds."""
        for prefix in reversed(hashes):
            holders = self.holders.get(prefix, 0) & eligible
            if holders:
                return holders
        return 0

    def num_blocks_held(self, hashes: list[int], engine: int) -> int:
        """The leading blocks of a prompt (its `hashes`) that `engine` was sent."""
        return next((index + 1 for index in range(len(hashes) - 1, -1, -1)
                     if self.holders.get(hashes[index], 0) >> engine & 1), 0)

    def record(self, hashes: list[int], engine: int) -> None:
        bit = 1 << engine
        for prefix in hashes:
            self.holders[prefix] = self.holders.get(prefix, 0) | bit
            self.holders.move_to_end(prefix)
        while len(self.holders) > self.capacity:
            self.holders.popitem(last=False)

    def forget(self, engine: int) -> None:
        """The engine restarted with an empty cache."""
        keep = ~(1 << engine)
        for prefix in list(self.holders):
            holders = self.holders[prefix] & keep
            if holders:
                self.holders[prefix] = holders
            else:
                del self.holders[prefix]


@dataclass
class Router:
    policy: str
    block_size: int
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    _turns: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, "
                             f"not {self.policy!r}")

    def choose(self, prompts: Sequence[Sequence[int]], loads: Sequence[float | None],
               hashes: list[list[int]] | None = None) -> int:
        """The engine for a request of `prompts` (all go to one engine); `loads[i]` is None
        where engine i is not serving; `hashes`: the prompts' prefix_hashes, where the caller
        has them already. Raises LookupError when none is."""
        live = [rank for rank, load in enumerate(loads) if load is not None]
        if not live:
            raise LookupError("no engine is serving")
        turn = next(self._turns)
        if self.policy == "round_robin":
            return live[turn % len(live)]
        least = min(loads[rank] for rank in live)  # type: ignore[type-var]
        # Among equally loaded engines, take turns: idle engines share the first requests.
        least_loaded = [rank for rank in live if loads[rank] == least]
        chosen = least_loaded[turn % len(least_loaded)]
        if self.policy == "cache_aware":
            if hashes is None:
                hashes = [prefix_hashes(prompt, self.block_size) for prompt in prompts]
            holder = self._holder(hashes[0], loads, live, least)
            chosen = chosen if holder is None else holder
            for prompt_hashes in hashes:
                self.prefixes.record(prompt_hashes, chosen)
        return chosen

    def _holder(self, hashes: list[int], loads: Sequence[float | None], live: list[int],
                least: float) -> int | None:
        """The least loaded engine holding the prompt's longest held prefix, unless it is
        overloaded."""
        holders = self.prefixes.longest_held(hashes, sum(1 << rank for rank in live))
        if not holders:
            return None
        rank = min((rank for rank in live if holders >> rank & 1), key=loads.__getitem__)
        load = loads[rank]
        assert load is not None
        return rank if load <= least + max(OVERLOAD_SLACK, OVERLOAD_RATIO * least) else None
