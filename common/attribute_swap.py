"""Attributes replaced for the length of a `with` block, then put back as they were."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def attributes_replaced(replacements: Iterable[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each (owner, name, value): `owner.name` is `value` inside the block. Afterwards an
    attribute the owner held itself gets its old value back, and one it inherited (a class's
    method from a base) is removed again."""
    replacements = list(replacements)
    # What the owner's own __dict__ holds (a staticmethod stays one), or None: inherited.
    saved = [(owner, name, getattr(owner, "__dict__", {}).get(name))
             for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is not None:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
