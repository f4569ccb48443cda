"""Engine tier: the seed's test plan on a tiny random-weight Llama, in-process."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_helpers import (
    assert_equals_transformers_generate,
    assert_greedy_equal_or_near_tie,
    assert_no_leaks,
    greedy_request,
    make_core,
    run_to_completion,
)
from tests.model_fixtures import build_tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt) % 200 + 3 for i in range(length)]


def test_many_concurrent_requests_complete_with_the_right_token_counts(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_seqs=8, max_num_batched_tokens=64)
    requests = [greedy_request(prompt_of(5 + 3 * i, i), max_tokens=3 + i % 7) for i in range(24)]
    outputs = run_to_completion(core, requests)
    for request in requests:
        assert len(outputs[request.request_id]) == request.sampling.max_tokens
    assert max(len(trace.scheduled) for trace in core.traces) == 8


def test_a_waiting_request_joins_on_the_step_after_a_short_one_finishes(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_seqs=2)
    short = greedy_request(prompt_of(4), max_tokens=2, request_id="short")
    long = greedy_request(prompt_of(6, 1), max_tokens=20, request_id="long")
    waiting = greedy_request(prompt_of(5, 2), max_tokens=3, request_id="waiting")
    run_to_completion(core, [short, long, waiting])
    finished_at = next(t.step for t in core.traces if "short" in t.finished)
    joined_at = next(t.step for t in core.traces if "waiting" in t.scheduled)
    assert joined_at == finished_at + 1
    assert all(t.waited.get("waiting") == "no_seat" for t in core.traces if t.step < joined_at)
    assert "long" in core.traces[joined_at - 1].scheduled  # the long one kept running beside it


def test_a_long_prompt_prefills_in_chunks_while_others_decode(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_batched_tokens=32)
    decoders = [greedy_request(prompt_of(4, i), max_tokens=30, request_id=f"dec-{i}")
                for i in range(3)]
    for request in decoders:
        core.add_request(request)
    core.step()  # the three short prompts prefill together
    core.add_request(greedy_request(prompt_of(200, 9), max_tokens=2, request_id="long"))
    chunk_steps = []
    while core.has_work:
        core.step()
        trace = core.traces[-1]
        if "long" in trace.scheduled and trace.scheduled["long"] > 1:
            chunk_steps.append(trace)
    assert len(chunk_steps) >= 6, "a 200-token prompt must take several 32-token steps"
    for trace in chunk_steps:
        assert all(trace.scheduled.get(f"dec-{i}") == 1 for i in range(3))
        assert sum(trace.scheduled.values()) <= 32
    assert_no_leaks(core)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixed_batch_with_preemption_equals_each_request_alone(tiny_model_dir, reference_model,
                                                                compiled):
    """Greedy output equals transformers' generate, eager and torch.compile'd alike."""
    lengths = [3, 17, 40, 9, 64, 1, 25, 33]
    prompts = [prompt_of(n, i) for i, n in enumerate(lengths)]
    # 12 blocks of 16 tokens for 8 requests of up to 64 + 24 tokens: preemption is certain.
    core = make_core(tiny_model_dir, num_kv_blocks=12, max_num_batched_tokens=48,
                     compile=compiled)
    assert (core.runner.forward is not core.model) == compiled
    batch = [greedy_request(p, max_tokens=24) for p in prompts]
    together = run_to_completion(core, batch)
    assert core.scheduler.num_preemptions >= 1
    assert any(len(t.scheduled) > 1 for t in core.traces)

    def reference_logits(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return reference_model(torch.tensor([token_ids])).logits[0, -1]

    alone_core = make_core(tiny_model_dir)
    for prompt, request in zip(prompts, batch, strict=True):
        alone = run_to_completion(alone_core, [greedy_request(prompt, max_tokens=24)])
        assert_greedy_equal_or_near_tie(together[request.request_id], next(iter(alone.values())),
                                        prompt, reference_logits)
    assert_equals_transformers_generate(together, batch, reference_model)


def test_abort_frees_blocks_within_one_step(tiny_model_dir):
    core = make_core(tiny_model_dir)
    requests = [greedy_request(prompt_of(30, i), max_tokens=50) for i in range(4)]
    for request in requests:
        core.add_request(request)
    core.step()
    core.step()
    core.abort_requests([requests[0].request_id, requests[2].request_id])
    assert core.check_integrity() == []
    live_blocks = sum(len(r.block_tables[0]) for r in core.scheduler.running)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks - live_blocks
    core.abort_requests([r.request_id for r in requests])
    assert not core.has_work
    assert_no_leaks(core)


def test_static_batching_runs_batches_back_to_back(tiny_model_dir):
    core = make_core(tiny_model_dir, batching="static", max_num_seqs=4)
    requests = [greedy_request(prompt_of(6, i), max_tokens=2 + 6 * (i % 2)) for i in range(8)]
    run_to_completion(core, requests)
    second_batch = {r.request_id for r in requests[4:]}
    first_join = min(t.step for t in core.traces if second_batch & set(t.scheduled))
    last_of_first = max(t.step for t in core.traces
                        if {r.request_id for r in requests[:4]} & set(t.finished))
    assert first_join == last_of_first + 1


def test_refused_requests_leave_the_engine_untouched(tiny_model_dir):
    from engine.scheduler import RequestRefused

    core = make_core(tiny_model_dir, max_model_len=64)
    with pytest.raises(RequestRefused, match="maximum model length"):
        core.add_request(greedy_request(prompt_of(60), max_tokens=10))
    assert not core.has_work
    outputs = run_to_completion(core, [greedy_request(prompt_of(10), max_tokens=4)])
    assert [len(tokens) for tokens in outputs.values()] == [4]


def test_a_sliding_window_no_longer_caps_the_model_length(tmp_path):
    """Sliding-window layers attend through their window (tests/test_architectures.py checks
    the tokens): the model serves its whole context, beyond the window."""
    core = make_core(build_tiny_llama_dir(tmp_path, "mistral", sliding_window=32))
    assert core.max_model_len == core.ready_message.max_model_len == 256
    outputs = run_to_completion(core, [greedy_request(prompt_of(100), max_tokens=3)])
    assert [len(tokens) for tokens in outputs.values()] == [3]


def test_steps_of_prefill_chunks_only_sample_nothing(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_batched_tokens=16)
    core.add_request(greedy_request(prompt_of(50), max_tokens=3, request_id="alone"))
    first_steps = [core.step() for _ in range(3)]
    assert all(step.outputs == [] for step in first_steps)
    assert [core.traces[i].scheduled["alone"] for i in range(3)] == [16, 16, 16]
    tokens = []
    while core.has_work:
        tokens.extend(t for output in core.step().outputs for t in output.new_token_ids)
    assert core.traces[3].scheduled["alone"] == 2
    assert len(tokens) == 3
    assert_no_leaks(core)


def test_queue_time_is_reported_once_and_covers_the_steps_spent_waiting(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_seqs=1)
    core.add_request(greedy_request(prompt_of(4), max_tokens=6, request_id="first"))
    core.add_request(greedy_request(prompt_of(5, 1), max_tokens=3, request_id="second"))
    queue_times: dict[str, list[float | None]] = {"first": [], "second": []}
    waited_s = 0.0  # engine time of the steps that ran while "second" waited for a seat
    while core.has_work:
        step = core.step()
        for output in step.outputs:
            queue_times[output.request_id].append(output.queue_time_s)
        if "second" in core.traces[-1].waited:
            waited_s += step.stats.step_time_s
    for request_id, times in queue_times.items():
        assert times[0] is not None and times[0] >= 0.0, request_id
        assert times[1:] == [None] * (len(times) - 1), request_id
    assert waited_s > 0.0
    assert queue_times["second"][0] >= waited_s > queue_times["first"][0]
