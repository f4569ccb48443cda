"""Stop strings over streamed text.

Text that might be the start of a stop string is held back until the next delta decides
it, so a stop string never leaks into the output, not even partly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    text: str  # safe to emit now
    stopped: bool
    stop: str | None = None  # the stop string matched


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        self._stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        self._pending = ""  # text received but not yet emitted

    def feed(self, text: str) -> StopResult:
        if not self._stop:
            return StopResult(text, False)
        pending = self._pending + text
        match = self._earliest_match(pending)
        if match is not None:
            self._pending = ""
            return StopResult(pending[:match[0]], True, match[1])
        hold = self._partial_match_length(pending)
        self._pending = pending[len(pending) - hold :]
        return StopResult(pending[: len(pending) - hold], False)

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return pending

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        """(where, which) of the stop string found first (the earliest, then the first
        listed)."""
        found = [(text.find(s), s) for s in self._stop]
        return min(((i, s) for i, s in found if i >= 0), key=lambda m: m[0], default=None)

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self._stop):
                return length
        return 0
