"""How one token is shown in logprobs: its text (the single id decoded, as vLLM shows it)
and its exact UTF-8 bytes.

A byte-level BPE token can hold part of a multi-byte character; its decoded text is then
U+FFFD, but its bytes are the real ones, so the bytes of all tokens concatenated are the
UTF-8 of the text. The bytes come from the token's vocabulary string: a byte-level
alphabet character (GPT-2 style) or a `<0xNN>` byte-fallback piece stands for one byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from frontend.detokenizer import REPLACEMENT_CHAR

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable bytes stand for themselves, the other bytes
    for the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {chr(byte): byte for byte in printable}
    shifted = (byte for byte in range(256) if byte not in printable)
    for offset, byte in enumerate(shifted):
        alphabet[chr(256 + offset)] = byte
    return alphabet


@dataclass(frozen=True, slots=True)
class TokenText:
    text: str
    utf8: bytes


class TokenTexts:
    """Cached id → TokenText for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, TokenText] = {}

    def __call__(self, token_id: int) -> TokenText:
        shown = self._cache.get(token_id)
        if shown is None:
            shown = self._cache[token_id] = self._describe(token_id)
        return shown

    def _describe(self, token_id: int) -> TokenText:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:
            return TokenText(text, text.encode())
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        return TokenText(text, _piece_bytes(piece) if isinstance(piece, str) else text.encode())


def _piece_bytes(piece: str) -> bytes:
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    alphabet = byte_level_alphabet()
    if all(char in alphabet for char in piece):
        return bytes(alphabet[char] for char in piece)
    return piece.encode()
