"""Bounds on the numbers of constrained JSON output, where the schema sets none.

A JSON schema's `integer` or `number` admits any number of digits, and a small model that
starts writing digits may never stop (`"population": 1111…` until max_tokens). No parser maps
such a number to a machine value, so every JSON-bearing constrained output (json_object,
json_schema, tool arguments) also matches a second grammar, `number_bound_grammar`: the text
read lexically (JSON strings skipped, so digits inside strings are free) with each number
bounded:
- an integer (no fraction, no exponent) has at most 19 digits, the int64 range;
- any other number at most 17 significant digits (leading zeros of `0.000…` not counted, at
  most 16 of them) and an exponent of at most 3 digits.
A schema whose own numbers (`minimum`, `maximum`, their exclusive forms, `const`, `enum`) are
smaller than that allows as many leading zeros as they need, and one more; llguidance holds
integer bounds to the int64 range itself, so an integer never needs more digits. The engine
allows a token only when every grammar of the request allows it
(engine.sampling.grammar.Constraint).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

INTEGER_DIGITS = 19
SIGNIFICANT_DIGITS = 17
FRACTION_ZEROS = 16
EXPONENT_DIGITS = 3
NUMERIC_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "const")

STRING = r'"([^"\\]|\\.)*"'
OUTSIDE = r'[^"0-9\-]'  # any other character outside strings and numbers
AFTER_NUMBER = r'[^"0-9\-.eE+]'  # a number ends at a character that cannot extend it


@dataclass(frozen=True, slots=True)
class NumberBounds:
    fraction_zeros: int = FRACTION_ZEROS  # at most, after "0." and before the first digit

    @classmethod
    def of(cls, schemas: Iterable[Any]) -> NumberBounds:
        """The default bounds, widened to fit every small number the schemas name."""
        fraction_zeros = FRACTION_ZEROS
        for value in _numeric_values(list(schemas)):
            if 0 < abs(value) < 1:
                fraction_zeros = max(fraction_zeros, math.ceil(-math.log10(abs(value))))
        return cls(fraction_zeros)

    @property
    def number_regex(self) -> str:
        significant = SIGNIFICANT_DIGITS
        integer = f"0|[1-9][0-9]{{0,{INTEGER_DIGITS - 1}}}"
        mantissas = [
            "0",
            f"[1-9][0-9]{{0,{significant - 1}}}",
            f"0\\.0{{1,{self.fraction_zeros + 1}}}",
            f"0\\.0{{0,{self.fraction_zeros}}}[1-9][0-9]{{0,{significant - 1}}}",
            *(f"[1-9][0-9]{{{whole - 1}}}\\.[0-9]{{1,{significant - whole}}}"
              for whole in range(1, significant)),
        ]
        exponent = f"[eE][+-]?[0-9]{{1,{EXPONENT_DIGITS}}}"
        return f"-?(({integer})|({'|'.join(mantissas)})({exponent})?)"

    @property
    def json_text_regex(self) -> str:
        """JSON text whose numbers keep to the bounds; a number is maximal (the character after
        it cannot extend it), so a long one cannot pass as several short ones."""
        number = f"({self.number_regex})"
        return f"({STRING}|{OUTSIDE}|{number}({AFTER_NUMBER}|{STRING}))*{number}?"


def number_bound_grammar(schemas: Iterable[Any], start: str = "JSON_TEXT",
                         rules: str = "") -> str:
    """A Lark grammar whose `start` rule is given (JSON_TEXT: the bounded JSON text; `rules`
    defines whatever else `start` names, such as the free text before a tool call)."""
    regex = NumberBounds.of(schemas).json_text_regex
    return f"start: {start}\n{rules}JSON_TEXT: /{regex}/\n"


def _numeric_values(node: Any) -> Iterable[float]:
    if isinstance(node, list):
        for item in node:
            yield from _numeric_values(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in NUMERIC_KEYWORDS and _is_number(value):
                yield float(value)
            elif key == "enum" and isinstance(value, list):
                yield from (float(item) for item in value if _is_number(item))
            else:
                yield from _numeric_values(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
