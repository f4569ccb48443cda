"""`--model FILE.gguf`: a llama.cpp GGUF file served as it is.

`prepare_gguf` writes, once per file (keyed by its path, size and modification time), a small
directory under $LOOM_CACHE/gguf/ with what the frontend and the engine read besides the
weights: config.json and generation_config.json from the file's metadata, the tokenizer and
chat template it carries, and `gguf_source.json` naming the file. The engine reads the
weights from the GGUF itself (engine/weights/gguf.py), Q4_0, Q4_1 and Q4_K tensors kept as
4-bit codes, Q8_0 ones as 8-bit codes. The directory is named after the file, so the served
model name is the file's stem.

Importable without torch: launch.py resolves models with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

GGUF_SOURCE_FILE = "gguf_source.json"
LAYOUT_VERSION = 1  # bump when what prepare_gguf writes changes


def gguf_source(directory: str | Path) -> Path | None:
    """The GGUF file a prepared directory stands for; None for an ordinary HF directory."""
    source = Path(directory) / GGUF_SOURCE_FILE
    if not source.is_file():
        return None
    return Path(json.loads(source.read_text())["path"])


def prepare_gguf(model: str, cache_dir: Path, progress: Any = print,
                 with_tokenizer: bool = True) -> str:
    """The prepared directory for a GGUF file; ValueError naming the file for one that cannot
    be read, holds an architecture Loom does not read, or carries no usable tokenizer."""
    path = Path(model).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{LAYOUT_VERSION}|"
                         f"{with_tokenizer}".encode()).hexdigest()[:16]
    target = cache_dir / "gguf" / key / path.stem
    if gguf_source(target) is not None:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        _write_prepared(path, work, progress, with_tokenizer)
        try:
            os.rename(work, target)
        except OSError:  # another process prepared it first
            if gguf_source(target) is None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(target)


def read_gguf(path: Path) -> Any:
    """gguf's reader, metadata and all (~4 s for a 50k-token vocabulary): for preparing, once
    per file. The engine finds the tensors with engine.weights.gguf_file instead."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # damage surfaces as ValueError, struct.error, IndexError, ...
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
                         ) from exc


def _write_prepared(path: Path, out: Path, progress: Any, with_tokenizer: bool) -> None:
    from common.gguf_convert import (
        CONFIG_TENSORS,
        embedding_rows,
        generation_config,
        hf_config_from_gguf,
        hf_tensor_name,
        read_metadata,
        rope_factor_tensors,
        write_json,
    )
    from common.gguf_tokenizer import write_tokenizer

    reader = read_gguf(path)
    metadata = read_metadata(reader)
    names = {tensor.name for tensor in reader.tensors}
    try:
        config = hf_config_from_gguf(metadata, tied="output.weight" not in names,
                                     vocab_size=embedding_rows(reader.tensors),
                                     rope_factors=rope_factor_tensors(reader.tensors))
        for name in names - CONFIG_TENSORS:
            hf_tensor_name(name, config["model_type"])
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(config))
    if with_tokenizer:
        progress(f"reading the tokenizer and chat template of {path.name}")
        try:
            write_tokenizer(path, out, progress)
        except Exception as exc:
            raise ValueError(f"{path}: no usable tokenizer ({exc})") from exc
    write_json(out / GGUF_SOURCE_FILE, {"path": str(path)})
