"""A GGUF file's copy without its tokenizer's arrays, for reference models in tests.

transformers builds a model from a GGUF through gguf's GGUFReader, which turns every
metadata value into numpy views: ~18 s for Gemma 3's 262k-entry vocabulary on a 2-core
machine, though the model needs only the vocabulary's size. The copy keeps every other
key-value pair and the tensors byte for byte (their offsets are relative to the data section,
which starts aligned as before), and adds `<architecture>.vocab_size`.
"""

from __future__ import annotations

import mmap
import shutil
import struct
from pathlib import Path

from engine.weights.gguf_file import DEFAULT_ALIGNMENT, GGUF_MAGIC, Cursor

TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
_UINT32 = 4


def key_value(key: str, value_type: int, payload: bytes) -> bytes:
    encoded = key.encode()
    return struct.pack("<Q", len(encoded)) + encoded + struct.pack("<I", value_type) + payload


def without_vocabulary(source: Path, target: Path) -> Path:
    """Write `target`, `source` less its tokenizer arrays plus the vocabulary's size."""
    with open(source, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    assert buffer[:4] == GGUF_MAGIC, f"{source} is not a GGUF file"
    cursor = Cursor(buffer)
    cursor.offset = 4
    version, tensor_count, kv_count = cursor.take("IQQ")
    kept: list[bytes] = []
    alignment, architecture, vocab_size = DEFAULT_ALIGNMENT, "", 0
    for _ in range(kv_count):
        start = cursor.offset
        key = cursor.string()
        (value_type,) = cursor.take("I")
        value_start = cursor.offset
        if key == "tokenizer.ggml.tokens":
            vocab_size = cursor.take("IQ")[1]
            cursor.offset = value_start
        cursor.skip_value(value_type)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buffer, value_start)
        if key == "general.architecture":
            architecture = bytes(buffer[value_start + 8:cursor.offset]).decode()
        if key not in TOKENIZER_ARRAYS:
            kept.append(bytes(buffer[start:cursor.offset]))
    kept.append(key_value(f"{architecture}.vocab_size", _UINT32,
                          struct.pack("<I", vocab_size)))
    infos_start = cursor.offset
    for _ in range(tensor_count):
        cursor.string()
        (num_dims,) = cursor.take("I")
        cursor.take("Q" * num_dims + "IQ")
    infos = bytes(buffer[infos_start:cursor.offset])
    data_start = -(-cursor.offset // alignment) * alignment
    header = struct.pack("<4sIQQ", GGUF_MAGIC, version, tensor_count, len(kept))
    head = header + b"".join(kept) + infos
    with open(target, "wb") as out:
        out.write(head + bytes(-len(head) % alignment))
        with open(source, "rb") as data:
            data.seek(data_start)
            shutil.copyfileobj(data, out, 16 * 1024**2)
    return target
