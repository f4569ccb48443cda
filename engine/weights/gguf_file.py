"""The tensors of a GGUF file, found without parsing its metadata values.

gguf's GGUFReader turns every metadata value into numpy views, ~4 s for a 50k-token
vocabulary's strings and merges; loading weights needs none of them, only where each tensor
lies. This walks the header with `struct`, skipping values, and maps each tensor as gguf does
(float types as their dtype, quantized ones as bytes per row). Little-endian files only (all
llama.cpp writes).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: the row length first
    data: np.ndarray  # [rows, row length] in its dtype, or [rows, bytes per row] if quantized


class _Cursor:
    """Reads a GGUF header's fields in order from `offset`."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.offset = 0

    def take(self, layout: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + layout, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + layout)
        return values

    def string(self) -> str:
        (length,) = self.take("Q")
        text = bytes(self.buffer[self.offset:self.offset + length]).decode("utf-8")
        self.offset += length
        return text

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            (length,) = self.take("Q")
            self.offset += length
        elif value_type == _ARRAY:
            element_type, count = self.take("IQ")
            if element_type in _SCALAR_SIZES:
                self.offset += count * _SCALAR_SIZES[element_type]
            elif element_type == _STRING:  # a vocabulary: tens of thousands of strings
                offset, buffer = self.offset, self.buffer
                for _ in range(count):
                    offset += 8 + struct.unpack_from("<Q", buffer, offset)[0]
                self.offset = offset
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            self.offset += _SCALAR_SIZES[value_type]


def read_tensors(path: Path) -> list[GGUFTensor]:
    """ValueError naming the file if it is not a GGUF this can read."""
    try:
        return _read_tensors(path)
    except (struct.error, KeyError, ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
                         ) from exc


@dataclass(slots=True)
class KeyValue:
    """Where one metadata pair lies: from its key's length (`start`) to `end`."""

    key: str
    value_type: int
    start: int
    value_start: int
    end: int


@dataclass(slots=True)
class Header:
    version: int
    key_values: list[KeyValue]
    tensor_infos: list[tuple[str, tuple[int, ...], int, int]]  # name, dims, type, offset
    infos_start: int
    infos_end: int
    alignment: int

    @property
    def data_start(self) -> int:
        """The tensors' data: after the infos, aligned; tensor offsets count from here."""
        return -(-self.infos_end // self.alignment) * self.alignment


def read_header(buffer: Any) -> Header:
    """The header of a GGUF file's bytes, every value skipped (also tests/gguf_trim.py)."""
    if buffer[:4] != GGUF_MAGIC:
        raise ValueError("no GGUF magic")
    cursor = _Cursor(buffer)
    cursor.offset = 4
    version, tensor_count, kv_count = cursor.take("IQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    key_values, alignment = [], DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        start = cursor.offset
        key = cursor.string()
        (value_type,) = cursor.take("I")
        value_start = cursor.offset
        if key == "general.alignment" and value_type == 4:
            (alignment,) = cursor.take("I")
        else:
            cursor.skip_value(value_type)
        key_values.append(KeyValue(key, value_type, start, value_start, cursor.offset))
    infos_start = cursor.offset
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        (num_dims,) = cursor.take("I")
        dims = cursor.take("Q" * num_dims)
        kind, offset = cursor.take("IQ")
        infos.append((name, dims, kind, offset))
    return Header(version, key_values, infos, infos_start, cursor.offset, alignment)


def _read_tensors(path: Path) -> list[GGUFTensor]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    header = read_header(buffer)
    data_start = header.data_start
    whole = np.frombuffer(buffer, dtype=np.uint8)
    tensors = []
    for name, dims, kind_number, offset in header.tensor_infos:
        kind = GGMLQuantizationType(kind_number)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        rows = int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = dims[0] // block * block_bytes
        start = data_start + offset
        raw = whole[start:start + rows * row_bytes]
        if raw.size != rows * row_bytes:
            raise ValueError(f"tensor {name} runs past the end of the file")
        dtype = _FLOAT_DTYPES.get(kind.name)
        data = raw.view(dtype).reshape(rows, dims[0]) if dtype else raw.reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, kind, tuple(dims), data))
    return tensors
