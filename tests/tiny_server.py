"""A tiny random Llama that speaks through the default model's tokenizer, served by launch.py.

Random weights answer with arbitrary tokens fast, which is all that serving-path tests
(disconnects, overload, faults, bad input, soak) need. The tokenizer files come from the
default model (SmolLM2), so prompts, chat templates and detokenization are the real ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.launched_server import LaunchedServer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
TINY_MAX_MODEL_LEN = 2048
TINY_MODEL_NAME = "tiny-llama"


def build_tiny_served_model(path: Path | str) -> str:
    """A directory launch.py can serve: tiny random weights plus SmolLM2's tokenizer."""
    from common.default_model import resolve_model
    from tests.model_fixtures import build_tiny_llama_dir

    model_dir = Path(build_tiny_llama_dir(path, vocab_size=49152,
                                          max_position_embeddings=TINY_MAX_MODEL_LEN))
    source = Path(resolve_model(None))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, model_dir / name)
    return str(model_dir)


def tiny_server(model_dir: str, *extra_args: str) -> LaunchedServer:
    """Not started yet: call `.start(log_dir)`."""
    return LaunchedServer(["--model", model_dir, "--dtype", "float32",
                           "--served-model-name", TINY_MODEL_NAME, *extra_args])


_BUILT: dict[Path, str] = {}


def shared_tiny_model(tmp_path_factory) -> str:
    """Built once per test session (its temporary directory), whichever module asks first."""
    base = tmp_path_factory.getbasetemp()
    if base not in _BUILT:
        _BUILT[base] = build_tiny_served_model(tmp_path_factory.mktemp("tiny-model"))
    return _BUILT[base]
