"""Deadlines in the scheduler: a waiting request past its deadline is dropped unstarted, a
running one is finished with what it generated; either way its KV blocks go back."""

from __future__ import annotations

from common.protocol import FinishReason
from tests.scheduler_helpers import make_request, make_scheduler, run_step


def test_nothing_expires_before_its_deadline_or_without_one():
    scheduler = make_scheduler()
    timed = make_request("timed", prompt_len=4, timeout_s=5.0)
    scheduler.add(timed)
    scheduler.add(make_request("untimed", prompt_len=4))
    assert scheduler.expire(timed.queued_at + 4.9) == ([], [])
    assert len(scheduler.requests) == 2


def test_a_waiting_request_past_its_deadline_is_dropped_and_never_started():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("running", prompt_len=4, max_tokens=50, tenant="a"))
    waiting = make_request("waiting", prompt_len=4, timeout_s=1.0, tenant="b")
    scheduler.add(waiting)
    run_step(scheduler)
    never_started, cut_short = scheduler.expire(waiting.queued_at + 1.0)
    assert never_started == [waiting] and cut_short == []
    assert waiting.finish_reason == FinishReason.TIMEOUT and waiting.num_output_tokens == 0
    assert "waiting" not in scheduler.requests and not scheduler.waiting
    assert scheduler.fair_share.accounts["b"].num_waiting == 0
    trace = run_step(scheduler).trace
    assert "waiting" not in trace.scheduled and "waiting" not in trace.waited


def test_a_running_request_past_its_deadline_keeps_its_output_and_frees_its_blocks():
    scheduler = make_scheduler(num_blocks=16)
    request = make_request("r", prompt_len=10, max_tokens=50, timeout_s=2.0)
    scheduler.add(request)
    for _ in range(3):
        run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks < 16
    never_started, cut_short = scheduler.expire(request.queued_at + 2.5)
    assert never_started == [] and cut_short == [request]
    assert request.finish_reason == FinishReason.TIMEOUT and request.num_output_tokens == 3
    assert not scheduler.has_work
    assert scheduler.block_manager.num_free_blocks == 16
    assert scheduler.block_manager.check_integrity([]) == []


def test_a_preempted_request_with_output_counts_as_started():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    first = make_request("a", prompt_len=6, max_tokens=6)
    second = make_request("b", prompt_len=6, max_tokens=6, timeout_s=60.0)
    scheduler.add(first)
    scheduler.add(second)
    while second.num_preemptions == 0:
        run_step(scheduler)
    assert second in scheduler.waiting and second.num_output_tokens > 0
    never_started, cut_short = scheduler.expire(second.queued_at + 60.0)
    assert never_started == [] and cut_short == [second]
    assert scheduler.block_manager.check_integrity(scheduler.live_requests) == []
