"""Incremental detokenization with prefix/read offsets.

Decoding token by token breaks characters that byte-level tokenizers split over several
tokens, and loses the spacing that some decoders derive from the previous token. So each
step decodes a small window: `ids[prefix_offset:read_offset]` is text already emitted,
`ids[prefix_offset:]` is that text plus whatever the new tokens add. Text is emitted only
when the window no longer ends in U+FFFD (an incomplete UTF-8 sequence); the concatenated
deltas then equal `tokenizer.decode(all_ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is still held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text):
            if final:
                self._read_offset = len(self._ids)
            return ""
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
