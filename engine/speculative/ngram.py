"""Prompt lookup (vLLM's "ngram" method): the longest suffix of a request's tokens, between
`prompt_lookup_min` and `prompt_lookup_max` long, that occurred before in its prompt or
output proposes the tokens that followed its latest occurrence."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)
class NgramIndex:
    """Every n-gram of one request's tokens whose next token is known, mapped to the
    position after its latest occurrence; extended as tokens are appended."""

    sizes: range
    latest_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending before this position are in the table

    def catch_up(self, tokens: list[int]) -> None:
        for end in range(max(self.num_indexed, self.sizes.start), len(tokens)):
            for size in self.sizes:
                if size > end:
                    break
                self.latest_end[tuple(tokens[end - size:end])] = end
        self.num_indexed = len(tokens)

    def continuation(self, tokens: list[int], max_tokens: int, sizes: range | None = None,
                     ) -> list[int]:
        """What followed the longest earlier occurrence of the tokens' suffix (of one of
        `sizes`, default all the index keeps)."""
        self.catch_up(tokens)
        for size in reversed(self.sizes if sizes is None else sizes):
            if size > len(tokens):
                continue
            end = self.latest_end.get(tuple(tokens[-size:]))
            if end is not None:
                return tokens[end:end + max_tokens]
        return []


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.sizes = range(lookup_min, lookup_max + 1)
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self._index(request).continuation(request.token_ids, max_drafts)

    def sure_draft(self, request: Request) -> list[int]:
        """The token after the latest earlier occurrence of the request's last
        `prompt_lookup_max` tokens (the longest match allowed), or none."""
        return self._index(request).continuation(request.token_ids, 1, self.sizes[-1:])

    def _index(self, request: Request) -> NgramIndex:
        # An index lives as long as its request: the tokens it read never change.
        index = self.indexes.get(request.request_id)
        if index is None:
            index = self.indexes[request.request_id] = NgramIndex(self.sizes)
        return index

    def finished(self, request: Request) -> None:
        self.indexes.pop(request.request_id, None)
