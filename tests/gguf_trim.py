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

from engine.weights.gguf_file import GGUF_MAGIC, read_header

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
    header = read_header(buffer)
    values = {pair.key: pair for pair in header.key_values}
    vocab_size = struct.unpack_from("<IQ", buffer, values["tokenizer.ggml.tokens"].value_start)[1]
    name = values["general.architecture"]
    architecture = bytes(buffer[name.value_start + 8:name.end]).decode()
    kept = [bytes(buffer[pair.start:pair.end]) for pair in header.key_values
            if pair.key not in TOKENIZER_ARRAYS]
    kept.append(key_value(f"{architecture}.vocab_size", _UINT32,
                          struct.pack("<I", vocab_size)))
    counts = struct.pack("<4sIQQ", GGUF_MAGIC, header.version, len(header.tensor_infos),
                         len(kept))
    head = counts + b"".join(kept) + bytes(buffer[header.infos_start:header.infos_end])
    with open(target, "wb") as out:
        out.write(head + bytes(-len(head) % header.alignment))
        with open(source, "rb") as data:
            data.seek(header.data_start)
            shutil.copyfileobj(data, out, 16 * 1024**2)
    return target
