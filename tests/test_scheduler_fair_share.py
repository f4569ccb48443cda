"""Fair share across tenants (engine.fair_share): weighted virtual token counters decide whose
waiting request is admitted next and whose running request is preempted."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.fair_share import DECODE_TOKEN_COST, PREFILL_TOKEN_COST
from engine.request import RequestStatus
from engine.scheduler import Scheduler, WaitReason
from tests.scheduler_helpers import make_request, make_scheduler, run_step, run_until_idle


def add_requests(scheduler: Scheduler, tenant: str, count: int, max_tokens: int = 50,
                 weight: float = 1.0) -> None:
    """`count` requests of 4 prompt tokens for `tenant`, named tenant0, tenant1, ..."""
    for index in range(count):
        scheduler.add(make_request(f"{tenant}{index}", prompt_len=4, max_tokens=max_tokens,
                                   tenant=tenant, tenant_weight=weight))


def admission_order(scheduler: Scheduler, max_steps: int = 1000) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_work:
            break
        before = {request.request_id for request in scheduler.running}
        output = run_step(scheduler)
        order += [rid for rid in output.trace.scheduled if rid not in before
                  and rid not in order]
    return order


def test_counters_charge_uncached_prompt_tokens_at_admission_and_outputs_as_generated():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", prompt_len=10, max_tokens=3, tenant="a", tenant_weight=2.0))
    run_step(scheduler)  # the whole prompt in one step, and one sampled token
    assert scheduler.fair_share.counter("a") == (10 * PREFILL_TOKEN_COST
                                                 + 1 * DECODE_TOKEN_COST) / 2.0
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.fair_share.counter("a") == (10 * PREFILL_TOKEN_COST
                                                 + 3 * DECODE_TOKEN_COST) / 2.0


def test_a_prefix_cache_hit_is_not_charged():
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(100, 112))
    scheduler.add(make_request("first", prompt=prompt, max_tokens=1, tenant="a"))
    run_step(scheduler)
    charged = scheduler.fair_share.counter("a")
    scheduler.add(make_request("again", prompt=prompt, max_tokens=1, tenant="a"))
    run_step(scheduler)
    # 8 of the 12 prompt tokens come from the cache (never the last token's block).
    assert scheduler.fair_share.counter("a") - charged == 4 * PREFILL_TOKEN_COST + DECODE_TOKEN_COST


def test_a_flooding_tenant_does_not_keep_a_light_one_waiting():
    scheduler = make_scheduler(max_num_seqs=1)
    for index in range(6):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=2, tenant="a"))
    run_step(scheduler)  # a0 runs
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=2, tenant="b"))
    order = admission_order(scheduler)
    assert order[:2] == ["b0", "a1"]  # b0 next, ahead of a1..a5 that came before it


def test_fcfs_within_a_tenant_and_interleaved_across_equal_tenants():
    scheduler = make_scheduler(max_num_seqs=1)
    for index in range(3):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=2, tenant="a"))
    for index in range(3):
        scheduler.add(make_request(f"b{index}", prompt_len=4, max_tokens=2, tenant="b"))
    assert admission_order(scheduler) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_priorities_order_requests_within_a_tenant_only():
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    scheduler.add(make_request("a-late", prompt_len=4, max_tokens=2, priority=5, tenant="a"))
    scheduler.add(make_request("a-urgent", prompt_len=4, max_tokens=2, priority=0, tenant="a"))
    scheduler.add(make_request("b-late", prompt_len=4, max_tokens=2, priority=9, tenant="b"))
    scheduler.add(make_request("b-urgent", prompt_len=4, max_tokens=2, priority=1, tenant="b"))
    # Tenants alternate; within each, the urgent request goes first whatever the other's.
    assert admission_order(scheduler) == ["a-urgent", "b-urgent", "a-late", "b-late"]


def test_weights_two_to_one_give_output_tokens_two_to_one_under_saturation():
    scheduler = make_scheduler(num_blocks=512, max_num_seqs=3)
    for index in range(60):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=16, tenant="a",
                                   tenant_weight=2.0))
        scheduler.add(make_request(f"b{index}", prompt_len=4, max_tokens=16, tenant="b",
                                   tenant_weight=1.0))
    requests = list(scheduler.requests.values())
    for _ in range(400):  # both stay backlogged throughout
        run_step(scheduler)
    assert {request.tenant for request in scheduler.waiting} == {"a", "b"}
    generated = {"a": 0, "b": 0}
    for request in requests:
        generated[request.tenant] += request.num_output_tokens
    assert abs(generated["a"] / generated["b"] - 2.0) <= 0.2, generated


def test_work_conserving_a_lone_tenant_takes_every_seat():
    scheduler = make_scheduler(max_num_seqs=4)
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=50, tenant="b", tenant_weight=9))
    for index in range(5):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=50, tenant="a"))
    run_step(scheduler)
    assert sorted(r.request_id for r in scheduler.running) == ["a0", "a1", "a2", "b0"]
    assert scheduler.waiting[0].request_id == "a3"


def test_a_returning_tenant_banks_no_credit_for_its_idle_time():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("b-early", prompt_len=4, max_tokens=1, tenant="b"))
    for index in range(20):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=4, tenant="a"))
    for _ in range(30):  # b-early is done long since; a is served alone meanwhile
        run_step(scheduler)
    a_counter = scheduler.fair_share.counter("a")
    assert scheduler.fair_share.counter("b") < a_counter
    for index in range(3):
        scheduler.add(make_request(f"b{index}", prompt_len=4, max_tokens=4, tenant="b"))
    assert scheduler.fair_share.counter("b") == a_counter  # lifted to the least waiting
    order = admission_order(scheduler)
    # They alternate: b does not take three turns in a row on credit from its idle time.
    assert [rid[0] for rid in order[:6]] in (["a", "b"] * 3, ["b", "a"] * 3), order


def test_a_tenant_returning_to_an_empty_queue_takes_the_last_leavers_counter():
    scheduler = make_scheduler()
    scheduler.add(make_request("a0", prompt_len=20, max_tokens=1, tenant="a"))
    run_step(scheduler)
    assert not scheduler.waiting
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=1, tenant="b"))
    # a's counter as it is now (its prompt and first token), not as it was when it left.
    assert scheduler.fair_share.counter("b") == scheduler.fair_share.counter("a") == (
        20 * PREFILL_TOKEN_COST + DECODE_TOKEN_COST)


def test_preemption_takes_from_the_tenant_furthest_over_its_share():
    # 6 blocks of 4: a1 and a2 (6-token prompts) run first, b1 joins a step later and is
    # the most recently admitted; when a1 needs a third block, a2 goes, not b1.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    scheduler.add(make_request("a1", prompt_len=6, max_tokens=8, tenant="a"))
    scheduler.add(make_request("a2", prompt_len=6, max_tokens=8, tenant="a"))
    run_step(scheduler)
    scheduler.add(make_request("b1", prompt_len=6, max_tokens=8, tenant="b", tenant_weight=4))
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a1", "a2", "b1"]
    preempted = []
    while not preempted:
        preempted = run_step(scheduler).trace.preempted
    assert preempted == ["a2"]
    assert scheduler.requests["b1"].status is RequestStatus.RUNNING


def test_a_victim_scheduled_earlier_in_the_step_gives_its_chunk_back():
    # a1 (first in the running list) fits this step; b1 needs a block; a is over its share,
    # so a1 is preempted and its chunk leaves the step.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    scheduler.add(make_request("a1", prompt_len=5, max_tokens=8, tenant="a"))
    scheduler.add(make_request("b1", prompt_len=8, max_tokens=8, tenant="b", tenant_weight=4))
    run_step(scheduler)
    trace = run_step(scheduler).trace  # run_step checks the KV accounting
    assert trace.preempted == ["a1"]
    assert trace.scheduled == {"b1": 1}
    assert trace.waited == {"a1": WaitReason.PREEMPTION}


def test_one_tenant_preempts_the_most_recently_admitted_as_before():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    for request_id in "abc":
        scheduler.add(make_request(request_id, prompt_len=8, max_tokens=8, tenant="t"))
    run_step(scheduler)
    assert run_step(scheduler).trace.preempted == ["c"]



@pytest.mark.parametrize("seed", range(40))
def test_random_tenant_workloads_finish_with_sound_kv_accounting(seed):
    """Small caches, every batching and chunking mode, three tenants of random weights:
    every request finishes and the KV accounting holds after every step (run_step checks).
    Without chunked prefill a request never grows past the step budget: a preempted one
    that had would wait for ever (its recompute never fits), tenants or not."""
    rng = random.Random(seed)
    budget = rng.choice([6, 8, 16])
    chunked = rng.random() < 0.5
    scheduler = make_scheduler(num_blocks=rng.randint(6, 12), block_size=4, max_model_len=40,
                               max_num_batched_tokens=budget, max_num_seqs=rng.randint(1, 4),
                               enable_chunked_prefill=chunked,
                               batching=rng.choice(["continuous", "static"]),
                               fair_step_rows=rng.choice([None, 1, 2]))
    weights = {tenant: rng.choice([0.5, 1.0, 3.0]) for tenant in "abc"}
    added = []
    for index in range(rng.randint(3, 10)):
        tenant = rng.choice("abc")
        prompt_len = rng.randint(1, 5)
        most = 12 if chunked else budget - prompt_len
        request = make_request(f"{tenant}{index}", prompt_len=prompt_len,
                               max_tokens=rng.randint(1, most), tenant=tenant,
                               tenant_weight=weights[tenant])
        scheduler.add(request)
        added.append(request)
    run_until_idle(scheduler)
    assert all(request.is_finished for request in added)


def test_a_tenant_under_its_share_takes_a_seat_from_a_tenant_over_its_share():
    """Seats full of a flooding tenant's requests: a light tenant's request is admitted in
    the step it arrives, the flooding tenant's most recently admitted one preempted, until
    the light tenant holds its share (2 of 4 seats here); then its next waits."""
    scheduler = make_scheduler(max_num_seqs=4)
    add_requests(scheduler, "a", 8)
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a0", "a1", "a2", "a3"]
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=50, tenant="b"))
    output = run_step(scheduler)
    assert "b0" in output.trace.scheduled and output.trace.preempted == ["a3"]
    assert "a3" not in output.trace.scheduled
    assert sorted(r.request_id for r in scheduler.running) == ["a0", "a1", "a2", "b0"]
    scheduler.add(make_request("b1", prompt_len=4, max_tokens=50, tenant="b"))
    output = run_step(scheduler)  # b holds one seat of its two
    assert "b1" in output.trace.scheduled and output.trace.preempted == ["a2"]
    scheduler.add(make_request("b2", prompt_len=4, max_tokens=50, tenant="b"))
    output = run_step(scheduler)  # b holds its share: its next waits for a seat to free
    assert output.trace.preempted == [] and "b2" not in output.trace.scheduled
    assert sorted(r.request_id for r in scheduler.running) == ["a0", "a1", "b0", "b1"]


def test_an_arrival_takes_as_many_seats_as_its_share_in_one_step():
    scheduler = make_scheduler(max_num_seqs=6)
    add_requests(scheduler, "a", 8)
    run_step(scheduler)
    add_requests(scheduler, "b", 5)
    output = run_step(scheduler)
    assert sorted(output.trace.preempted) == ["a3", "a4", "a5"]
    assert sorted(r.request_id for r in scheduler.running if r.tenant == "b") == [
        "b0", "b1", "b2"]


def test_saturating_tenants_take_a_seat_from_each_other_once_not_back_and_forth():
    scheduler = make_scheduler(max_num_seqs=6)
    add_requests(scheduler, "one", 30, max_tokens=8)
    run_step(scheduler)
    add_requests(scheduler, "two", 30, max_tokens=8, weight=2.0)
    tenant_of = {f"{name}{i}": name for name in ("one", "two") for i in range(30)}
    shares = {"one": 2, "two": 4}  # 6 seats by weights 1:2
    for _ in range(60):
        held = Counter(request.tenant for request in scheduler.running)
        output = run_step(scheduler)
        for victim in output.trace.preempted:  # from a tenant over its share to one under
            giver = tenant_of[victim]
            taker = "two" if giver == "one" else "one"
            assert held[giver] > shares[giver] and held[taker] < shares[taker]
    assert 1 <= scheduler.num_preemptions <= 8


def test_a_returning_tenant_lifted_to_a_tie_goes_before_the_tenant_holding_more_seats():
    scheduler = make_scheduler(max_num_seqs=4)
    for index in range(8):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=50, tenant="a"))
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=50, tenant="b"))
    run_step(scheduler)
    run_step(scheduler)  # b0 holds a seat; b has nothing waiting
    scheduler.add(make_request("b1", prompt_len=4, max_tokens=50, tenant="b"))
    assert scheduler.fair_share.counter("b") == scheduler.fair_share.counter("a")  # lifted
    assert scheduler.fair_share.pick_waiting(scheduler.waiting, scheduler.running,
                                             4).request_id == "b1"


def test_a_tenant_under_its_share_starts_in_a_step_of_its_own():
    """Seats full of a flooding tenant's decodes: a light tenant's arrival runs its prefill in
    a step without them (they wait that one step), then everyone decodes together."""
    scheduler = make_scheduler(max_num_seqs=4)
    add_requests(scheduler, "a", 8)
    run_step(scheduler)
    run_step(scheduler)  # a0..a3 decoding
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=50, tenant="b"))
    output = run_step(scheduler)
    assert list(output.trace.scheduled) == ["b0"] and output.trace.preempted == ["a3"]
    assert {output.trace.waited[rid] for rid in ("a0", "a1", "a2")} == {WaitReason.FAIR_STEP}
    output = run_step(scheduler)
    assert sorted(output.trace.scheduled) == ["a0", "a1", "a2", "b0"]


def test_no_step_of_its_own_without_a_tenant_over_its_share():
    """Two tenants each within its share of the seats: arrivals join the decodes' step."""
    scheduler = make_scheduler(max_num_seqs=8)
    add_requests(scheduler, "a", 2)
    run_step(scheduler)
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=50, tenant="b"))
    output = run_step(scheduler)
    assert sorted(output.trace.scheduled) == ["a0", "a1", "b0"]


def test_contending_tenants_get_steps_of_fair_step_rows_rows_taken_in_turns():
    """A flooding tenant holding 5 of 6 seats, a light one 1, at most 3 rows a step: the light
    tenant's request runs every step (its share of a step's rows is 1), the others take
    turns (each at least every 3 steps)."""
    scheduler = make_scheduler(max_num_seqs=6, fair_step_rows=3)
    add_requests(scheduler, "a", 12, max_tokens=100)
    run_step(scheduler)
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=100, tenant="b"))
    run_step(scheduler)  # b0's step of its own
    last_ran = {request.request_id: scheduler.step_count for request in scheduler.running}
    for _ in range(12):
        output = run_step(scheduler)
        assert len(output.trace.scheduled) == 3 and "b0" in output.trace.scheduled
        for request_id in output.trace.scheduled:
            last_ran[request_id] = scheduler.step_count
        assert all(scheduler.step_count - step < 3 for step in last_ran.values())


def test_tenants_within_their_share_holding_more_rows_than_a_step_starve_nobody():
    """b came first and holds 3 of 8 seats, over its share of 2 once a (weight 3, share 6)
    holds 5; 4 rows a step: b's requests still run in turn, not only a's."""
    scheduler = make_scheduler(max_num_seqs=8, fair_step_rows=4)
    add_requests(scheduler, "b", 3, max_tokens=100)
    run_step(scheduler)
    add_requests(scheduler, "a", 5, max_tokens=100, weight=3.0)
    run_step(scheduler)
    assert Counter(request.tenant for request in scheduler.running) == {"a": 5, "b": 3}
    runs: Counter[str] = Counter()
    for _ in range(8):
        runs.update(request_id[0] for request_id in run_step(scheduler).trace.scheduled)
    assert runs["b"] >= 8 and runs["a"] >= 16


def test_a_lone_tenant_is_not_held_to_fair_step_rows():
    scheduler = make_scheduler(max_num_seqs=6, fair_step_rows=2)
    add_requests(scheduler, "a", 6, max_tokens=10)
    run_step(scheduler)
    assert len(run_step(scheduler).trace.scheduled) == 6
