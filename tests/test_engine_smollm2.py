"""The correctness oracle on the real default model: a mixed, chunked, preempting batch of
greedy requests equals transformers' own `generate`, token for token (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.default_model import resolve_model
from tests.engine_helpers import (
    assert_equals_transformers_generate,
    greedy_request,
    make_core,
    run_to_completion,
)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean, then explain why the sky looks blue during the day "
    "and red at sunset, in simple words a child could follow.",
    "2+2=",
    "Translate 'good morning' into Spanish and German.",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    return resolve_model(None)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            for q in QUESTIONS]


def test_mixed_batch_equals_transformers_generate(smollm2_dir, reference, prompts):
    # 14 blocks of 16 tokens cannot hold all five prompts (37-70 tokens) plus 20 outputs each:
    # the scheduler must preempt; a 32-token budget chunks every prompt.
    core = make_core(smollm2_dir, num_kv_blocks=14, max_num_batched_tokens=32)
    batch = [greedy_request(prompt, max_tokens=MAX_TOKENS) for prompt in prompts]
    outputs = run_to_completion(core, batch)
    assert core.scheduler.num_preemptions >= 1
    assert any(len(trace.scheduled) >= 3 for trace in core.traces)
    assert_equals_transformers_generate(outputs, batch, reference)
