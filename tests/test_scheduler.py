"""Scheduler unit tests: budget, seats, chunking, preemption order, priority, refusal."""

from __future__ import annotations

import pytest

from engine.scheduler import RequestRefused, WaitReason
from tests.scheduler_helpers import (
    FILLER_TOKEN,
    make_request,
    make_scheduler,
    run_step,
    run_until_idle,
)


def test_token_budget_is_shared_and_prompts_are_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    for request_id in "abc":
        scheduler.add(make_request(request_id, prompt_len=10))
    trace = run_step(scheduler).trace
    assert trace.scheduled == {"a": 10, "b": 6}
    assert trace.waited == {"c": WaitReason.NO_BUDGET}
    trace = run_step(scheduler).trace
    # a decodes (1 token), b finishes its prompt (4), c gets the rest of the budget (10).
    assert trace.scheduled == {"a": 1, "b": 4, "c": 10}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    scheduler.add(make_request("a", prompt_len=10))
    scheduler.add(make_request("b", prompt_len=10))
    trace = run_step(scheduler).trace
    assert trace.scheduled == {"a": 10}
    assert trace.waited == {"b": WaitReason.NO_BUDGET}


def test_seat_limit():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add(make_request(request_id, prompt_len=3))
    trace = run_step(scheduler).trace
    assert set(trace.scheduled) == {"a", "b"}
    assert trace.waited == {"c": WaitReason.NO_SEAT}


def test_a_finished_request_frees_its_seat_for_the_next_step():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("short", prompt_len=3, max_tokens=2))
    scheduler.add(make_request("next", prompt_len=3, max_tokens=2))
    outputs = run_until_idle(scheduler)
    finish_step = next(o.trace.step for o in outputs if "short" in o.trace.finished)
    join_step = next(o.trace.step for o in outputs if "next" in o.trace.scheduled)
    assert join_step == finish_step + 1


def test_long_prompt_prefills_in_chunks_while_decodes_continue():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_request("decoder", prompt_len=4, max_tokens=20))
    run_step(scheduler)  # decoder's prefill
    scheduler.add(make_request("long", prompt_len=30, max_tokens=2))
    chunk_sizes = []
    for _ in range(5):
        trace = run_step(scheduler).trace
        assert trace.scheduled["decoder"] == 1
        chunk_sizes.append(trace.scheduled["long"])
    assert chunk_sizes[:4] == [7, 7, 7, 7] and chunk_sizes[4] == 2


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    # 6 blocks of 4 tokens; three 8-token prompts take all but... then decodes need blocks.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    for request_id in "abc":
        scheduler.add(make_request(request_id, prompt_len=8, max_tokens=8))
    scheduler.add(make_request("d", prompt_len=2, max_tokens=1))
    run_step(scheduler)  # a, b, c fill every block; d has no block
    trace = run_step(scheduler).trace  # a needs a 3rd block: c (admitted last) is preempted
    assert trace.preempted == ["c"]
    assert [r.request_id for r in scheduler.waiting][:1] == ["c"]
    assert scheduler.num_preemptions >= 1
    outputs = run_until_idle(scheduler)
    finished = [rid for o in outputs for rid in o.trace.finished]
    assert sorted(finished) == ["a", "b", "c", "d"]


def test_preempted_request_keeps_its_tokens_and_recomputes_them():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    scheduler.add(make_request("a", prompt_len=6, max_tokens=6))
    scheduler.add(make_request("b", prompt_len=6, max_tokens=6))
    outputs = run_until_idle(scheduler)
    assert scheduler.num_preemptions >= 1
    finished = {rid for o in outputs for rid in o.trace.finished}
    assert finished == {"a", "b"}


def test_priority_policy_orders_waiting_requests():
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    scheduler.add(make_request("first-low", prompt_len=2, priority=5))
    scheduler.add(make_request("urgent", prompt_len=2, priority=0))
    scheduler.add(make_request("second-low", prompt_len=2, priority=5))
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "first-low", "second-low"]


def test_fcfs_policy_ignores_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("first", prompt_len=2, priority=5))
    scheduler.add(make_request("second", prompt_len=2, priority=0))
    assert [r.request_id for r in scheduler.waiting] == ["first", "second"]


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "config", "message"),
    [
        (60, 10, {}, "exceeds the maximum model length"),
        (30, 10, {"num_blocks": 5}, "the whole cache holds"),
        (20, 2, {"max_num_batched_tokens": 8, "enable_chunked_prefill": False},
         "chunked prefill is off"),
        (0, 2, {}, "empty"),
    ],
)
def test_impossible_requests_are_refused_at_admission(prompt_len, max_tokens, config, message):
    scheduler = make_scheduler(max_model_len=64, **config)
    with pytest.raises(RequestRefused, match=message):
        scheduler.add(make_request("r", prompt_len=prompt_len, max_tokens=max_tokens))
    assert not scheduler.has_work


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    scheduler.add(make_request("r", prompt_len=2))
    with pytest.raises(RequestRefused, match="already in use"):
        scheduler.add(make_request("r", prompt_len=2))


def test_abort_frees_blocks_immediately():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add(make_request("a", prompt_len=10, max_tokens=10))
    scheduler.add(make_request("b", prompt_len=10, max_tokens=10))
    run_step(scheduler)
    scheduler.abort(["a", "b", "unknown"])
    assert scheduler.block_manager.num_free_blocks == 8
    assert not scheduler.has_work
    assert scheduler.block_manager.check_integrity([]) == []


def test_static_batching_admits_nothing_until_the_batch_finishes():
    scheduler = make_scheduler(batching="static", max_num_seqs=2)
    scheduler.add(make_request("a", prompt_len=3, max_tokens=1))
    scheduler.add(make_request("b", prompt_len=3, max_tokens=5))
    scheduler.add(make_request("c", prompt_len=3, max_tokens=1))
    outputs = run_until_idle(scheduler)
    a_done = next(o.trace.step for o in outputs if "a" in o.trace.finished)
    b_done = next(o.trace.step for o in outputs if "b" in o.trace.finished)
    c_start = next(o.trace.step for o in outputs if "c" in o.trace.scheduled)
    assert a_done < b_done < c_start
    assert all(o.trace.waited.get("c") == WaitReason.BATCH_CLOSED
               for o in outputs if o.trace.step < c_start)


def test_output_tokens_and_stops():
    scheduler = make_scheduler()
    request = make_request("r", prompt_len=3, max_tokens=4)
    scheduler.add(request)
    run_until_idle(scheduler)
    assert request.output_token_ids == [FILLER_TOKEN] * 4
    assert request.finish_reason == "length"


def test_eos_stops_unless_ignored_and_min_tokens_defers_it():
    scheduler = make_scheduler()
    stopped = make_request("stopped", prompt_len=2, max_tokens=5)
    ignoring = make_request("ignoring", prompt_len=2, max_tokens=3, ignore_eos=True)
    for request in (stopped, ignoring):
        scheduler.add(request)
    while scheduler.has_work:
        output = scheduler.schedule()
        scheduler.update(output, {c.request.request_id: [0] for c in output.chunks
                                  if c.completes_sequence})
    assert stopped.output_token_ids == [0] and stopped.finish_reason == "stop"
    assert ignoring.output_token_ids == [0, 0, 0] and ignoring.finish_reason == "length"
