"""The served model's tokenizer, for prompt lengths and for counting output tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

MAX_FIT_ROUNDS = 8


class BenchTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        self._plain_ids = [i for i in range(len(tokenizer)) if i not in special]
        self._overhead: dict[tuple[str | None, bool], int] = {}

    @classmethod
    def load(cls, model_dir: str | Path) -> BenchTokenizer:
        # The same loader choice as the frontend: tokenizer.json needs no torch import.
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if (Path(model_dir) / "tokenizer.json").is_file():
            return cls(PreTrainedTokenizerFast.from_pretrained(str(model_dir)))
        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def encode(self, text: str) -> list[int]:
        """Token ids of generated text: no special tokens added."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def prompt_len(self, prompt: str, system: str | None, chat: bool) -> int:
        if not chat:
            return len(self._tokenizer.encode(prompt, add_special_tokens=True))
        return len(self.encode_chat(prompt, system))

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        # As the frontend does it: render, then encode; the template holds the special tokens.
        text = self._tokenizer.apply_chat_template(
            chat_messages(prompt, system), tokenize=False, add_generation_prompt=True)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def template_overhead(self, system: str | None, chat: bool) -> int:
        """Prompt tokens around an empty user message."""
        key = (system, chat)
        if key not in self._overhead:
            self._overhead[key] = self.prompt_len("", system, chat)
        return self._overhead[key]

    def random_text(self, rng: random.Random, num_tokens: int) -> str:
        """Text of random plain tokens that re-encodes to about num_tokens tokens."""
        ids = rng.choices(self._plain_ids, k=num_tokens)
        text = ""
        for _ in range(MAX_FIT_ROUNDS):
            text = self._tokenizer.decode(ids)
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                break
            if len(ids) > num_tokens:
                ids = ids[:num_tokens]
            else:
                ids = ids + rng.choices(self._plain_ids, k=num_tokens - len(ids))
        return text


def chat_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return [*messages, {"role": "user", "content": prompt}]
