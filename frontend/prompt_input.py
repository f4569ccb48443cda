"""The four forms of a completions `prompt`: a string, a list of strings, a list of token
ids, a list of lists of token ids. Each is read as a list of prompts, each prompt a
string (to tokenize) or token ids."""

from __future__ import annotations

from typing import Any

from frontend.body_reader import check_token_id
from frontend.errors import invalid_param

Prompt = str | list[int]


def parse_prompts(raw: Any, vocab_size: int, param: str = "prompt") -> list[Prompt]:
    """`param`: the field's name (embeddings call it `input`)."""
    if raw is None:
        raise invalid_param(param, f"'{param}' is required.", code="missing_required_parameter")
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list) or not raw:
        raise invalid_param(
            param,
            f"'{param}' must be a string, a list of strings, a list of token ids, "
            "or a list of lists of token ids; it must not be empty.",
        )
    if all(isinstance(item, str) for item in raw):
        return list(raw)
    if all(isinstance(item, list) for item in raw):
        return [_token_ids(item, vocab_size, param) for item in raw]
    return [_token_ids(raw, vocab_size, param)]


def _token_ids(raw: list[Any], vocab_size: int, param: str) -> list[int]:
    if not raw:
        raise invalid_param(param, "A token-id prompt must not be empty.")
    return [check_token_id(param, item, vocab_size) for item in raw]
