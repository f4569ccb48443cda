"""A GGUF file's tokenizer and chat template, saved as a Hugging Face tokenizer directory and
checked against the file's own: the same ids for a probe text and the same rendered chat.

Importable without torch (transformers is imported where it is used).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_tokenizer(gguf_path: Path, out: Path, progress: Callable[[str], None]) -> None:
    from transformers import AutoTokenizer

    progress("converting the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:  # a base model: completions, chat with --chat-template
        progress(f"{gguf_path.name} carries no chat template")
    tokenizer.save_pretrained(str(out))
    _check_saved_tokenizer(out, tokenizer)


def _check_saved_tokenizer(out: Path, original: Any) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(out))
    probe = "What is the capital of France? Ça va — 東京."
    if saved.encode(probe) != original.encode(probe):
        raise RuntimeError("the saved tokenizer does not encode as the GGUF's does")
    if not original.chat_template:
        return
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered != expected or saved.encode(rendered) != original.encode(expected):
        raise RuntimeError("the saved tokenizer does not reproduce the GGUF chat template")
