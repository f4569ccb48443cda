"""Requests that share a long system prompt and differ in a short question.

`--prefix-len` tokens of shared prompt (one of `--num-prefixes`), then `--input-len`
tokens of the request's own. On chat endpoints the prefix is the system message.
"""

from __future__ import annotations

import random

from bench.datasets.sample import DatasetSpec, SampleRequest, draw_length
from bench.datasets.tokenizer import BenchTokenizer

DEFAULT_QUESTION_LEN = 64


def shared_prefix_requests(spec: DatasetSpec, tokenizer: BenchTokenizer) -> list[SampleRequest]:
    rng = random.Random(spec.seed)
    prefixes = [tokenizer.random_text(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
    samples = []
    for index in range(spec.num_prompts):
        prefix = prefixes[index % len(prefixes)]
        question_len = draw_length(rng, spec.input_len or DEFAULT_QUESTION_LEN, spec.range_ratio)
        question = tokenizer.random_text(rng, question_len)
        if spec.chat:
            prompt, system = question, prefix
        else:
            prompt, system = f"{prefix}\n\n{question}", None
        samples.append(SampleRequest(
            prompt=prompt,
            prompt_len=tokenizer.prompt_len(prompt, system, spec.chat),
            output_len=draw_length(rng, spec.output_len, spec.range_ratio),
            system=system,
        ))
    return samples
