"""A Hugging Face directory's safetensors, read lazily: a tensor's bytes are read when its
layer slices it, so a tensor-parallel rank reads only its own rows or columns."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.layers.linear import CheckpointTensor

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


def read_safetensors(directory: Path, device: torch.device,
                     ) -> Iterator[tuple[str, CheckpointTensor]]:
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device=str(device)) as file:
            for name in file.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if not _IGNORED.fullmatch(name):
                    yield name, file.get_slice(name)
