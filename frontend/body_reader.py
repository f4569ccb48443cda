"""Typed, range-checked reads of fields from a JSON request body.

A missing field and an explicit null both mean "use the default", as in the OpenAI API.
Every failure is an APIError that names the parameter.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from frontend.errors import APIError, invalid_param


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"The request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise APIError("The request body nests JSON too deeply.") from exc
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    field = _field_with_lone_surrogate(body)
    if field is not None:
        raise invalid_param(field, f"'{field}' holds a lone UTF-16 surrogate (such as "
                            "\\ud800): valid JSON, but not text that can be encoded.")
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def _field_with_lone_surrogate(body: dict[str, Any]) -> str | None:
    """The path (`messages[0].content`) of a string holding a surrogate code point, which
    JSON's \\uXXXX escapes can spell alone and no tokenizer can encode; a nested object
    whose keys hold one counts as that object. (Top-level keys are names the API knows or
    ignores.) The walk keeps its own stack: json.loads accepts nesting deeper than a
    recursive walk could follow."""
    stack: list[tuple[str, Any]] = list(body.items())
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, dict):
            if any(_SURROGATE.search(name) for name in value):
                return path
            stack.extend((f"{path}.{name}", item) for name, item in value.items())
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: Any) -> int | None:
    """An integer, or an integral float (10.0); None for anything else."""
    if is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


class BodyReader:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def present(self, name: str) -> bool:
        return self.body.get(name) is not None

    def integer(
        self,
        name: str,
        default: int | None,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int | None:
        raw = self.body.get(name)
        if raw is None:
            return default
        value = as_int(raw)
        if value is None:
            raise invalid_param(name, f"'{name}' must be an integer, got {raw!r}.")
        if minimum is not None and value < minimum:
            raise invalid_param(name, f"'{name}' must be at least {minimum}, got {value}.")
        if maximum is not None and value > maximum:
            raise invalid_param(name, f"'{name}' must be at most {maximum}, got {value}.")
        return value

    def number(
        self,
        name: str,
        default: float,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> float:
        raw = self.body.get(name)
        if raw is None:
            return default
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
            raise invalid_param(name, f"'{name}' must be a number, got {raw!r}.")
        value = float(raw)
        if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
            bound = "greater than" if exclusive_minimum else "at least"
            raise invalid_param(name, f"'{name}' must be {bound} {minimum}, got {raw}.")
        if maximum is not None and value > maximum:
            raise invalid_param(name, f"'{name}' must be at most {maximum}, got {raw}.")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        raw = self.body.get(name)
        if raw is None:
            return default
        if not isinstance(raw, bool):
            raise invalid_param(name, f"'{name}' must be a boolean, got {raw!r}.")
        return raw

    def string(self, name: str) -> str | None:
        raw = self.body.get(name)
        if raw is not None and not isinstance(raw, str):
            raise invalid_param(name, f"'{name}' must be a string, got {raw!r}.")
        return raw

    def token_id_list(self, name: str, vocab_size: int) -> list[int]:
        raw = self.body.get(name)
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise invalid_param(name, f"'{name}' must be a list of token ids.")
        return [check_token_id(name, value, vocab_size) for value in raw]


def check_token_id(param: str, value: Any, vocab_size: int) -> int:
    token_id = as_int(value)
    if token_id is None or not 0 <= token_id < vocab_size:
        raise invalid_param(
            param, f"'{param}' holds {value!r}, not a token id in [0, {vocab_size})."
        )
    return token_id
