"""The field types every wire message is made of (common.protocol): token ids as
little-endian int32 bytes, strictly checked fields, and the error a malformed frame raises."""

from __future__ import annotations

import array
import sys
from typing import Any


class FrameError(ValueError):
    """A frame that cannot be decoded into a known message."""


def pack_token_ids(token_ids: list[int] | array.array) -> bytes:
    packed = token_ids if isinstance(token_ids, array.array) else array.array("i", token_ids)
    if sys.byteorder != "little":
        packed = array.array("i", packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(blob: bytes) -> list[int]:
    if not isinstance(blob, bytes) or len(blob) % 4:
        raise FrameError("token ids must be int32 bytes")
    unpacked = array.array("i")
    unpacked.frombytes(blob)
    if sys.byteorder != "little":
        unpacked.byteswap()
    return unpacked.tolist()


def expect(value: Any, expected: Any, name: str) -> None:
    if isinstance(value, bool) and expected in (int, float | int):
        raise FrameError(f"{name} must not be a bool")
    if not isinstance(value, expected):
        raise FrameError(f"{name} has type {type(value).__name__}")
