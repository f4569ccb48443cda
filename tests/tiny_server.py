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
ANSWER_TOKEN = " the"


def build_tiny_served_model(path: Path | str) -> str:
    """A directory launch.py can serve: tiny random weights plus SmolLM2's tokenizer."""
    from tests.model_fixtures import build_tiny_llama_dir

    model_dir = build_tiny_llama_dir(path, vocab_size=49152,
                                     max_position_embeddings=TINY_MAX_MODEL_LEN)
    copy_default_tokenizer(model_dir)
    return model_dir


def copy_default_tokenizer(model_dir: Path | str) -> None:
    """The default model's tokenizer and chat template, fetched first if need be."""
    from common.default_model import resolve_model

    source = Path(resolve_model(None))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, Path(model_dir) / name)


def build_answer_model(path: Path) -> str:
    """A tiny random Llama with SmolLM2's tokenizer whose greedy answer is ANSWER_TOKEN
    repeated: attention and MLP outputs are zeroed, every embedding is the same vector and
    only ANSWER_TOKEN's lm_head row sees it. Re-encoding such an answer gives back exactly
    the generated tokens, so the tokenizer's count must equal the server's usage."""
    import torch

    from bench.datasets import BenchTokenizer
    from common.default_model import resolve_model
    from tests.model_fixtures import build_tiny_hf_model

    tokenizer = BenchTokenizer.load(resolve_model(None))
    (answer_id,) = tokenizer.encode(ANSWER_TOKEN)
    model = build_tiny_hf_model(vocab_size=49152, max_position_embeddings=1024)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[answer_id] = 1.0
    model_dir = path / "tiny-answer-model"
    model.save_pretrained(model_dir)
    copy_default_tokenizer(model_dir)
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
