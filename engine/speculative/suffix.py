"""Suffix decoding (vLLM's "suffix" method, after Arctic Inference's SuffixDecoding):
drafts from how often each token followed the request's latest context in its own prompt
and output (searched for) and in the outputs of recent finished requests (counted: agents
repeat themselves across requests). The longest context seen (up to `max_depth` tokens)
predicts the next token; drafting goes on while the product of those frequencies stays at
least `min_token_prob`, at most `max_spec_factor` tokens per matched context token.

Contexts are keyed by a polynomial hash modulo 2^64: a collision can only cost a rejected
draft. Only some context lengths are counted (1-4, 6, 9, 13, 19, 24: `counted_lengths`): the
longest match is found within one of them, at a third of the work of every length. The
hashes of every position's contexts come from one prefix sum (numpy), so counting a token
is a few dict updates, and a request's own windows are arrays of hashes, grown as its
tokens arrive."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.request import Request

# A probe's draft (engine.speculative.speculator): the context matched at least this long,
# and the token followed it at least this share of the time.
SURE_CONTEXT = 6
SURE_SHARE = 0.5
# Up to this many positions are counted one by one (a dozen integer operations a context);
# more, a context length at a time over numpy arrays (~10 us a length to set up).
FEW_POSITIONS = 4

_MASK = (1 << 64) - 1
_BASE = 1_000_003
_INVERSE = pow(_BASE, -1, 1 << 64)


def counted_lengths(max_depth: int) -> frozenset[int]:
    """1, 2, 3, 4, then each about 1.5 times the last, and max_depth itself."""
    lengths, length = {1, 2, 3, 4, max_depth}, 4
    while length < max_depth:
        length = length * 3 // 2
        lengths.add(min(length, max_depth))
    return frozenset(n for n in lengths if n <= max_depth)


def context_hashes(tokens: list[int], end: int, max_depth: int,
                   lengths: frozenset[int]) -> list[tuple[int, int]]:
    """(n, hash of tokens[end - n:end]) for the counted lengths n up to max_depth (as far
    as `end` allows), shortest first. The hash of a window is the sum of (token + 1) *
    BASE^k mod 2^64, k counting back from its last token (0) to its first."""
    hashes = []
    value, power = 0, 1
    for length, position in enumerate(range(end - 1, max(end - max_depth, 0) - 1, -1), 1):
        value = (value + (tokens[position] + 1) * power) & _MASK
        power = (power * _BASE) & _MASK
        if length in lengths:
            hashes.append((length, value))
    return hashes


@dataclass(slots=True)
class _Powers:
    """BASE^k and BASE^-k mod 2^64 as uint64 arrays, grown on demand."""

    up: np.ndarray = field(default_factory=lambda: np.ones(1, np.uint64))
    down: np.ndarray = field(default_factory=lambda: np.ones(1, np.uint64))

    def upto(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.up) < count:
            size = max(count, 2 * len(self.up))
            self.up, self.down = np.ones(size, np.uint64), np.ones(size, np.uint64)
            np.cumprod(np.full(size - 1, _BASE, np.uint64), out=self.up[1:])
            np.cumprod(np.full(size - 1, _INVERSE, np.uint64), out=self.down[1:])
        return self.up[:count], self.down[:count]


_POWERS = _Powers()


@dataclass(frozen=True, slots=True)
class Windows:
    """Hashes of the windows of tokens[base:stop], any length, from one prefix sum of
    (token + 1) * BASE^-i: every counted length reads the same sum."""

    base: int
    prefix: np.ndarray  # [stop - base + 1]

    @classmethod
    def of(cls, tokens: list[int], base: int, stop: int) -> Windows:
        values = np.asarray(tokens[base:stop], dtype=np.uint64) + np.uint64(1)
        _, down = _POWERS.upto(len(values) + 1)
        prefix = np.zeros(len(values) + 1, np.uint64)
        np.cumsum(values * down[:len(values)], out=prefix[1:])
        return cls(base, prefix)

    def hashes(self, length: int, first_end: int, last_end: int) -> np.ndarray:
        """context_hashes' value of tokens[p - length:p] for every p in [first_end,
        last_end] (each window inside [base, stop))."""
        ends = np.arange(first_end - self.base, last_end - self.base + 1)
        up, _ = _POWERS.upto(len(self.prefix))
        return up[ends - 1] * (self.prefix[ends] - self.prefix[ends - length])


def window_hashes(tokens: list[int], first: int, stop: int, length: int) -> np.ndarray:
    """context_hashes' value of tokens[p - length:p] for every p in [first + length, stop],
    at once."""
    return Windows.of(tokens, first, stop).hashes(length, first + length, stop)


@dataclass(slots=True)
class FollowCounts:
    """context hash -> {next token: count}, over the sequences added to it."""

    max_depth: int
    counts: dict[int, dict[int, int]] = field(default_factory=dict)
    lengths: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = counted_lengths(self.max_depth)

    def add(self, tokens: list[int], start: int, stop: int, sign: int = 1) -> None:
        """Counts the tokens at positions start..stop-1 after their contexts."""
        start = max(start, 1)
        if stop - start <= FEW_POSITIONS:  # a step's new tokens: no arrays for so few
            self._count(((key, tokens[position]) for position in range(start, stop)
                         for _, key in context_hashes(tokens, position, self.max_depth,
                                                      self.lengths)), sign)
            return
        windows = Windows.of(tokens, max(start - max(self.lengths), 0), stop - 1)
        for length in self.lengths:
            begin = max(start, length)  # the first position with a whole context
            if begin < stop:
                keys = windows.hashes(length, begin, stop - 1).tolist()
                self._count(zip(keys, tokens[begin:stop], strict=True), sign)

    def followers(self, length: int, key: int) -> dict[int, int]:
        """What followed the context hashing to `key` (its length is in the hash)."""
        return self.counts.get(key, {})

    def _count(self, pairs: Iterable[tuple[int, int]], sign: int) -> None:
        counts = self.counts
        for key, token in pairs:
            follow = counts.get(key)
            if follow is None:
                follow = counts[key] = {}
            count = follow.get(token, 0) + sign
            if count > 0:
                follow[token] = count
            else:
                follow.pop(token, None)
                if not follow:
                    del counts[key]


class Contexts(Protocol):
    """A request's own contexts, counted (FollowCounts) or searched (History)."""

    def followers(self, length: int, key: int) -> dict[int, int]: ...


@dataclass(slots=True)
class History:
    """A running request's own contexts: for each counted length, the hash of every window
    of its tokens that some token followed, searched (numpy) when it drafts rather than
    counted into dicts: a request's first drafts came with a catch-up over its whole prompt,
    ~2-3 ms of dict updates at a few hundred tokens. Arrays grow by doubling; the window
    of `length` tokens ending at position p (followed by token p) is keys[length][p - length]."""

    max_depth: int
    lengths: frozenset[int]
    keys: dict[int, np.ndarray] = field(default_factory=dict)
    seen: dict[int, set[int]] = field(default_factory=dict)  # the same keys, tested first
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    num_indexed: int = 0  # tokens read; windows end before the last of them

    def catch_up(self, tokens: list[int]) -> None:
        """Indexes the windows that the tokens read since last time follow."""
        start, stop = max(self.num_indexed, 1), len(tokens)
        if start >= stop:
            return
        for length, new in self._new_keys(tokens, start, stop).items():
            self._store(length, stop - length, new)
        self.tokens = _room(self.tokens, stop)
        self.tokens[self.num_indexed:stop] = tokens[self.num_indexed:stop]
        self.num_indexed = stop

    def _new_keys(self, tokens: list[int], start: int, stop: int,
                  ) -> dict[int, np.ndarray | list[int]]:
        """By length, the hashes of the windows ending at start..stop-1 (those whole)."""
        if stop - start <= FEW_POSITIONS:  # a step's new tokens: no arrays for so few
            new: dict[int, list[int]] = {}
            for position in range(start, stop):
                for length, key in context_hashes(tokens, position, self.max_depth,
                                                  self.lengths):
                    new.setdefault(length, []).append(key)
            return new
        windows = Windows.of(tokens, max(start - max(self.lengths), 0), stop - 1)
        return {length: windows.hashes(length, max(start, length), stop - 1)
                for length in self.lengths if max(start, length) < stop}

    def _store(self, length: int, size: int, new: np.ndarray | list[int]) -> None:
        """Puts `new` as the last keys of `length`, `size` of them in all."""
        keys = self.keys[length] = _room(self.keys.get(length, _EMPTY), size)
        keys[size - len(new):size] = new
        self.seen.setdefault(length, set()).update(
            new.tolist() if isinstance(new, np.ndarray) else new)

    def followers(self, length: int, key: int) -> dict[int, int]:
        """What followed each window of `length` tokens hashing to `key`: token -> count, in
        order of first occurrence (as FollowCounts would hold it)."""
        if key not in self.seen.get(length, ()):
            return {}
        keys = self.keys[length][:self.num_indexed - length]
        follow: dict[int, int] = {}
        for token in self.tokens[(keys == np.uint64(key)).nonzero()[0] + length].tolist():
            follow[token] = follow.get(token, 0) + 1
        return follow


_EMPTY = np.zeros(0, np.uint64)


def _room(array: np.ndarray, size: int) -> np.ndarray:
    """`array`, or a copy twice as long, so that it holds at least `size` values."""
    if len(array) >= size:
        return array
    grown = np.empty(max(size, 2 * len(array)), array.dtype)
    grown[:len(array)] = array
    return grown


def likeliest(follow: dict[int, int]) -> tuple[int, float]:
    """The token that followed a context most often, and its share of the continuations."""
    token, count = max(follow.items(), key=lambda item: item[1])
    return token, count / sum(follow.values())


class SuffixProposer:
    def __init__(self, max_depth: int, max_spec_factor: float, min_token_prob: float,
                 max_cached_requests: int) -> None:
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        self.running: dict[str, History] = {}
        self.shared = FollowCounts(max_depth)  # outputs of finished requests
        self.shared_outputs: deque[list[int]] = deque()

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self.drafts_from(self._history(request), request.token_ids, max_drafts)

    def sure_draft(self, request: Request) -> list[int]:
        """The likeliest next token where a context of at least SURE_CONTEXT tokens was
        followed by it at least SURE_SHARE of the time, else none."""
        return self.sure_from(self._history(request), request.token_ids)

    def drafts_from(self, own: Contexts, tokens: list[int], max_drafts: int) -> list[int]:
        """The walk from the end of `tokens` (`own`: what followed their contexts)."""
        tokens = tokens[-self.max_depth:]
        drafts: list[int] = []
        probability = 1.0
        limit = max_drafts
        while len(drafts) < limit:
            order, follow = self._longest_context(own, tokens)
            if not follow:
                break
            token, share = likeliest(follow)
            probability *= share
            if probability < self.min_token_prob:
                break
            if not drafts:
                limit = min(max_drafts, math.ceil(self.max_spec_factor * order))
            drafts.append(token)
            tokens = [*tokens, token][-self.max_depth:]
        return drafts

    def sure_from(self, own: Contexts, tokens: list[int]) -> list[int]:
        order, follow = self._longest_context(own, tokens[-self.max_depth:])
        if order < SURE_CONTEXT or not follow:
            return []
        token, share = likeliest(follow)
        return [token] if share >= SURE_SHARE else []

    def _history(self, request: Request) -> History:
        own = self.running.get(request.request_id)
        if own is None:
            own = self.running[request.request_id] = History(self.max_depth, self.shared.lengths)
        own.catch_up(request.token_ids)
        return own

    def _longest_context(self, own: Contexts, tokens: list[int],
                         ) -> tuple[int, dict[int, int]]:
        """The longest suffix of `tokens` followed by anything, here or in finished
        requests' outputs, and what followed it (both counts added)."""
        hashes = context_hashes(tokens, len(tokens), self.max_depth, self.shared.lengths)
        for order, key in reversed(hashes):
            mine, theirs = own.followers(order, key), self.shared.counts.get(key)
            if mine and theirs:
                merged = dict(theirs)
                for token, count in mine.items():
                    merged[token] = merged.get(token, 0) + count
                return order, merged
            if mine or theirs:
                return order, mine or theirs
        return 0, {}

    def finished(self, request: Request) -> None:
        """A finished request's output joins what later requests draft from (the oldest
        leaves beyond `max_cached_requests`)."""
        if self.running.pop(request.request_id, None) is None or not self.max_cached_requests:
            return
        if request.finish_reason == "abort" or request.num_output_tokens < 2:
            return
        output = request.output_token_ids
        self.shared.add(output, 0, len(output))
        self.shared_outputs.append(output)
        while len(self.shared_outputs) > self.max_cached_requests:
            old = self.shared_outputs.popleft()
            self.shared.add(old, 0, len(old), sign=-1)
