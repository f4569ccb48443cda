"""One benchmark request before it is sent, and the knobs that shape a workload."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"


@dataclass(slots=True)
class SampleRequest:
    prompt: str  # the user message (chat) or the whole prompt (completions)
    prompt_len: int  # tokens the server sees, chat template included
    output_len: int  # sent as max_tokens
    system: str | None = None  # chat only: a system message before the prompt


@dataclass(slots=True)
class DatasetSpec:
    name: str = "random"  # random | prompts | shared-prefix
    num_prompts: int = 100
    input_len: int | None = None  # None: random and shared-prefix use 256; prompts any length
    output_len: int = 128
    range_ratio: float = 0.0  # lengths drawn uniformly from len * [1 - ratio, 1 + ratio]
    prefix_len: int = 512  # shared-prefix: tokens of the shared system prompt
    num_prefixes: int = 1  # shared-prefix: distinct shared prompts, requests spread evenly
    prompts_file: Path = DEFAULT_PROMPTS_FILE
    chat: bool = False  # lengths count the chat template when the endpoint is chat
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.num_prompts < 1 or self.output_len < 1:
            raise ValueError("num_prompts and output_len must be positive")


def draw_length(rng: random.Random, length: int, ratio: float) -> int:
    low = max(1, round(length * (1 - ratio)))
    high = max(low, round(length * (1 + ratio)))
    return rng.randint(low, high)
