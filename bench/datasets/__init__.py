"""Benchmark workloads, built with the served model's tokenizer so lengths are in its tokens."""

from __future__ import annotations

from collections.abc import Callable

from bench.datasets.prompts_file import prompts_requests, write_prompts
from bench.datasets.random_tokens import random_requests
from bench.datasets.sample import DEFAULT_PROMPTS_FILE, DatasetSpec, SampleRequest
from bench.datasets.shared_prefix import shared_prefix_requests
from bench.datasets.tokenizer import BenchTokenizer, chat_messages

Builder = Callable[[DatasetSpec, BenchTokenizer], list[SampleRequest]]

DATASETS: dict[str, Builder] = {
    "random": random_requests,
    "prompts": prompts_requests,
    "shared-prefix": shared_prefix_requests,
}


def build_dataset(spec: DatasetSpec, tokenizer: BenchTokenizer) -> list[SampleRequest]:
    return DATASETS[spec.name](spec, tokenizer)


__all__ = ["DATASETS", "DEFAULT_PROMPTS_FILE", "BenchTokenizer", "DatasetSpec",
           "SampleRequest", "build_dataset", "chat_messages", "write_prompts"]
