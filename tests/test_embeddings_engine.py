"""Embedding requests (`SamplingParams.pooling`) in the engine, on tiny random-weight models
in fp32: the pooled, normalized final hidden states equal transformers' own
`hidden_states[-1]` pooled the same way, whatever else shares the step, however the prompt
is chunked, after preemption and beside prefix-cache hits."""

from __future__ import annotations

import numpy as np
import pytest

from common.protocol import AddRequest
from common.sampling import SamplingParams
from tests.engine_helpers import (
    assert_no_leaks,
    greedy_request,
    make_core,
    reference_embedding,
)
from tests.model_fixtures import build_tiny_llama_dir


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model_dir(request, tmp_path_factory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp(request.param), request.param)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(5 * i + 11 * salt) % 190 + 3 for i in range(length)]


def embedding_request(request_id: str, prompt: list[int], kind: str) -> AddRequest:
    return AddRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                         pooling=kind), 0.0)


def run(core, requests: list[AddRequest],
        cached: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Each embedding request's vector (and, into `cached`, its prefix-cache hit)."""
    for request in requests:
        core.add_request(request)
    vectors: dict[str, np.ndarray] = {}
    while core.has_work:
        for output in core.step().outputs:
            if output.embedding is not None:
                assert output.finish_reason is not None
                vectors[output.request_id] = np.frombuffer(output.embedding, "<f4")
                if cached is not None:
                    cached[output.request_id] = output.num_cached_tokens
    assert_no_leaks(core)
    return vectors


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_pooled_states_equal_transformers_beside_generations_in_chunks_and_preempted(
        model_dir: str, kind: str) -> None:
    prompts = {f"e{i}": prompt_of(length, i) for i, length in enumerate((7, 40, 95, 33))}
    core = make_core(model_dir, max_num_batched_tokens=32, max_num_seqs=5, num_kv_blocks=12)
    generations = [greedy_request(prompt_of(30, 7 + i), 60) for i in range(3)]
    requests = [embedding_request(name, prompt, kind) for name, prompt in prompts.items()]
    vectors = run(core, generations + requests)
    preempted = {name for trace in core.traces for name in trace.preempted}
    assert preempted & set(prompts), preempted  # an embedding recomputed from its start
    assert any(trace.scheduled.get("e2", 0) not in (0, 95) for trace in core.traces)  # chunked
    for name, prompt in prompts.items():
        want = reference_embedding(model_dir, prompt, kind)
        cosine = float(np.dot(vectors[name], want))
        assert cosine >= 0.9999, (name, cosine)
        assert abs(np.linalg.norm(vectors[name]) - 1) < 1e-5


def test_a_cached_prompt_is_hit_by_last_pooling_and_computed_whole_by_mean(
        model_dir: str) -> None:
    core = make_core(model_dir)
    prompt = prompt_of(70, 3)
    run(core, [greedy_request(prompt, 5)])  # leaves the prompt's blocks cached
    cached: dict[str, int] = {}
    vectors = run(core, [embedding_request(kind, prompt, kind) for kind in ("last", "mean")],
                  cached)
    assert cached == {"last": 64, "mean": 0}
    for kind in ("last", "mean"):
        assert float(np.dot(vectors[kind], reference_embedding(model_dir, prompt, kind))) >= 0.9999
