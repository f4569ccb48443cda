"""`--speculative-config`: vLLM's JSON for speculative decoding, parsed and checked once.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}
    {"method": "draft_model", "model": "<dir or GGUF file>", "num_speculative_tokens": 4}

Keys as vLLM names them; an unknown key, method or value is a ValueError naming it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 0  # 0: the method's default (5; suffix: its tree depth)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched (default 2)
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched (default 5)
    model: str | None = None  # draft_model: a served architecture sharing the tokenizer
    # No drafting while more requests than this run (vLLM's key; None: never off by count).
    disable_by_batch_size: int | None = None
    # suffix: the longest context matched, the most tokens per matched context token, the
    # least frequency a drafted token must have after its context, requests kept to learn from.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 1000

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, not {self.method!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be positive")
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": a model directory or file')
        if not 1 <= self.lookup_min <= self.lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.lookup_min} and {self.lookup_max}")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be positive and "
                             "suffix_decoding_max_cached_requests not negative")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be positive")

    @property
    def max_drafts(self) -> int:
        if self.num_speculative_tokens:
            return self.num_speculative_tokens
        return self.suffix_decoding_max_tree_depth if self.method == "suffix" else 5

    @property
    def lookup_min(self) -> int:
        """vLLM's rule: one bound given stands for both (neither: 2 to 5 here)."""
        if self.prompt_lookup_min is None:
            return 2 if self.prompt_lookup_max is None else self.prompt_lookup_max
        return self.prompt_lookup_min

    @property
    def lookup_max(self) -> int:
        if self.prompt_lookup_max is None:
            return 5 if self.prompt_lookup_min is None else self.prompt_lookup_min
        return self.prompt_lookup_max

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown --speculative-config keys {unknown}; known: "
                             f"{sorted(known)}")
        if "method" not in values:
            raise ValueError(f'--speculative-config needs "method", one of {METHODS}')
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"--speculative-config: {exc}") from exc
