"""Token logprobs in the two OpenAI shapes: chat (`content[]` of token objects) and the
legacy completions one (parallel `tokens` / `token_logprobs` / `top_logprobs` /
`text_offset` lists)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend.generation import TokenLogprob
from frontend.token_texts import TokenTexts

# JSON has no -inf; a token the model gives probability 0 is shown at this floor.
LOGPROB_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


@dataclass(slots=True)
class ChatLogprobs:
    texts: TokenTexts

    def format(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._token(entry) for entry in entries], "refusal": None}

    def _token(self, entry: TokenLogprob) -> dict[str, Any]:
        return {
            **self._described(entry.token_id, entry.logprob),
            "top_logprobs": [self._described(token_id, value) for token_id, value in entry.top],
        }

    def _described(self, token_id: int, logprob: float) -> dict[str, Any]:
        shown = self.texts(token_id)
        return {"token": shown.text, "logprob": _clamp(logprob), "bytes": list(shown.utf8)}


@dataclass(slots=True)
class CompletionLogprobs:
    """`top_logprobs[i]` holds the top-N tokens and, as OpenAI always returns it, the
    sampled one: up to N + 1 entries."""

    texts: TokenTexts

    def format(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {
            "tokens": [self.texts(entry.token_id).text for entry in entries],
            "token_logprobs": [_clamp(entry.logprob) for entry in entries],
            "top_logprobs": [self._top(entry) for entry in entries],
            "text_offset": [entry.text_offset for entry in entries],
        }

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        # Tokens that show as the same text share a key; the likeliest one keeps it.
        for token_id, value in [*entry.top, (entry.token_id, entry.logprob)]:
            top.setdefault(self.texts(token_id).text, _clamp(value))
        return top


LogprobsFormat = ChatLogprobs | CompletionLogprobs
