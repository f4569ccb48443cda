"""Prefix caching on the tiny model: same greedy output with it on or off; shared prompts
prefill once."""

from __future__ import annotations

import pytest

from tests.engine_helpers import assert_no_leaks, greedy_request, make_core, run_to_completion
from tests.model_fixtures import build_tiny_llama_dir

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=1024)


def tokens(length: int, salt: int) -> list[int]:
    return [(11 * i + 17 * salt) % 190 + 5 for i in range(length)]


def workload() -> list[list[int]]:
    """Prompts sharing a system prefix at block-aligned and off-by-one lengths, interleaved
    with unrelated ones."""
    system = tokens(3 * BLOCK, salt=1)
    prompts = []
    for index, shared_len in enumerate([BLOCK, 2 * BLOCK, 3 * BLOCK, BLOCK + 1, 2 * BLOCK - 1,
                                        3 * BLOCK]):
        prompts.append(system[:shared_len] + tokens(5 + index, salt=10 + index))
        prompts.append(tokens(9 + 3 * index, salt=50 + index))  # unrelated
    prompts.append(list(system))  # exactly the cached chain: its last token is recomputed
    return prompts


def generate(model_dir: str, prefix_caching: bool, arrive_in_waves: bool) -> list[list[int]]:
    core = make_core(model_dir, enable_prefix_caching=prefix_caching,
                     max_num_batched_tokens=64)
    requests = [greedy_request(prompt, max_tokens=12) for prompt in workload()]
    if arrive_in_waves:  # the first wave's blocks are cached before the second arrives
        first = run_to_completion(core, requests[:4])
        rest = run_to_completion(core, requests[4:])
        outputs = {**first, **rest}
    else:
        outputs = run_to_completion(core, requests)
    if prefix_caching and arrive_in_waves:
        assert core.block_manager.stats.hits > 0
    if not prefix_caching:
        assert core.block_manager.stats.hits == 0
    return [outputs[request.request_id] for request in requests]


@pytest.mark.parametrize("arrive_in_waves", [False, True], ids=["together", "in-waves"])
def test_greedy_output_is_the_same_with_prefix_caching_on_and_off(tiny_model_dir,
                                                                   arrive_in_waves):
    assert generate(tiny_model_dir, True, arrive_in_waves) == \
        generate(tiny_model_dir, False, arrive_in_waves)


def test_four_samples_of_one_prompt_prefill_it_once(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_batched_tokens=2048)
    prompt = tokens(500, salt=3)
    # What the frontend sends for n=4: four requests with the same prompt, arriving together.
    requests = [greedy_request(prompt, max_tokens=4, request_id=f"n4-{i}") for i in range(4)]
    outputs = run_to_completion(core, requests)
    prefill_tokens = core.totals.num_prompt_tokens
    # One full prefill; the three siblings recompute only their last partial block.
    assert prefill_tokens == 500 + 3 * (500 - 496)
    assert core.block_manager.stats.hits == 3 * 496
    assert len({tuple(tokens_out) for tokens_out in outputs.values()}) == 1
    waited = [t.waited for t in core.traces if t.waited]
    assert waited and all(set(w.values()) == {"prefix_pending"} for w in waited)


def test_memory_pressure_evicts_uncached_blocks_first_then_chains_tail_first(tiny_model_dir):
    core = make_core(tiny_model_dir, num_kv_blocks=20)
    prompt = tokens(4 * BLOCK + 3, salt=7)
    run_to_completion(core, [greedy_request(prompt, max_tokens=2)])
    run_to_completion(core, [greedy_request(prompt, max_tokens=2)])
    assert core.block_manager.stats.hits == 4 * BLOCK
    # Unrelated traffic needing 19 of the 20 blocks takes the 16 uncached blocks first, then
    # the cached chain tail first: only the chain's head block survives.
    run_to_completion(core, [greedy_request(tokens(300, salt=8), max_tokens=2)])
    run_to_completion(core, [greedy_request(prompt, max_tokens=2)])
    assert core.block_manager.stats.hits == 4 * BLOCK + BLOCK
    assert_no_leaks(core)
