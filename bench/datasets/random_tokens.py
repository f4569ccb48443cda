"""Random prompts of controlled token lengths: random plain tokens, fitted to the tokenizer."""

from __future__ import annotations

import random

from bench.datasets.sample import DatasetSpec, SampleRequest, draw_length
from bench.datasets.tokenizer import BenchTokenizer

DEFAULT_INPUT_LEN = 256


def random_requests(spec: DatasetSpec, tokenizer: BenchTokenizer) -> list[SampleRequest]:
    rng = random.Random(spec.seed)
    overhead = tokenizer.template_overhead(None, spec.chat)
    samples = []
    for _ in range(spec.num_prompts):
        target = draw_length(rng, spec.input_len or DEFAULT_INPUT_LEN, spec.range_ratio)
        text = tokenizer.random_text(rng, max(1, target - overhead))
        samples.append(SampleRequest(
            prompt=text,
            prompt_len=tokenizer.prompt_len(text, None, spec.chat),
            output_len=draw_length(rng, spec.output_len, spec.range_ratio),
        ))
    return samples
