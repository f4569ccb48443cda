"""A step gives way (engine.give_way): while tenants contend, a taped decode step stops between
kernels when a request of a tenant under its share arrives, and runs again later with the same
result; the frames read mid-step are kept, in order, for the server's next drain."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import zmq

from common.protocol import AddRequest, encode
from common.sampling import SamplingParams
from engine.core import EngineCore
from engine.give_way import ArrivalWatch, may_give_way
from tests.engine_helpers import assert_no_leaks, make_core
from tests.model_fixtures import build_tiny_llama_dir
from tests.scheduler_helpers import make_request, make_scheduler, run_step


def tenant_requests(seed: int) -> list[AddRequest]:
    """Two tenants' greedy requests of different prompt and output lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [AddRequest(f"{tenant}{i}",
                       torch.randint(3, 250, (3 + 4 * i,), generator=generator).tolist(),
                       SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True),
                       0.0, tenant=tenant)
            for tenant in ("a", "b") for i in range(3)]


def run(core: EngineCore, give_way=None) -> tuple[dict[str, list[int]], int]:
    """Every request's tokens, and how many steps gave way."""
    for request in tenant_requests(0):
        core.add_request(request)
    outputs: dict[str, list[int]] = {}
    gave_way = 0
    while core.has_work:
        step = core.step(give_way)
        if step is None:
            gave_way += 1
            continue
        for output in step.outputs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert_no_leaks(core)
    return outputs, gave_way


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["taped", "eager"])
def test_a_step_that_gave_way_runs_again_to_the_same_tokens(tmp_path, enforce_eager):
    """Every step that may is stopped once, at a different point each time: between kernels
    of a taped decode, before an attention layer of an eager forward (decodes, and prompt
    chunks of the tenant over its share of the 4 seats)."""
    model_dir = build_tiny_llama_dir(tmp_path, "llama")
    settings = {"block_size": 4, "enforce_eager": enforce_eager, "max_num_seqs": 4,
                "max_num_batched_tokens": 8}  # prompts in chunks; a tenant over its share
    want, _ = run(make_core(model_dir, **settings))
    asks = itertools.count()
    stop_at = itertools.cycle([0, 1, 2, 5])
    next_stop = [next(stop_at)]
    stopped_steps: set[int] = set()
    core = make_core(model_dir, **settings)

    def give_way() -> bool:
        step = core.scheduler.step_count
        if step in stopped_steps or next(asks) != next_stop[0]:
            return False
        stopped_steps.add(step)
        next_stop[0] += next(stop_at) + 1
        return True

    got, gave_way = run(core, give_way)
    assert got == want
    assert gave_way >= 5


def test_steps_with_one_tenant_or_a_prompt_chunk_within_its_share_never_give_way():
    scheduler = make_scheduler()
    scheduler.add(make_request("a0", prompt_len=4, tenant="a"))
    assert not may_give_way(scheduler.schedule(), scheduler)  # one tenant, a prompt chunk
    scheduler = make_scheduler()
    for name in ("a0", "b0"):
        scheduler.add(make_request(name, prompt_len=4, max_tokens=9, tenant=name[0]))
    output = scheduler.schedule()
    assert not may_give_way(output, scheduler)  # prompt chunks of tenants within their share
    scheduler.update(output, {"a0": [7], "b0": [7]})
    assert may_give_way(scheduler.schedule(), scheduler)  # two tenants' decodes


def test_a_prompt_chunk_of_a_tenant_over_its_share_may_give_way():
    scheduler = make_scheduler(max_num_seqs=4)
    for index in range(4):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=50, tenant="a"))
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=50, tenant="b"))
    output = scheduler.schedule()  # a holds 3 seats of its 2, b one: a's prompts may stop
    assert sorted(output.trace.scheduled) == ["a0", "a1", "a2", "b0"]
    assert not may_give_way(output, scheduler)  # b0's first chunk is in it
    scheduler = make_scheduler(max_num_seqs=4)
    for index in range(4):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=50, tenant="a"))
    run_step(scheduler)
    scheduler.add(make_request("b0", prompt_len=4, max_tokens=50, tenant="b"))
    run_step(scheduler)  # b0's step of its own, a3 preempted for its seat
    output = scheduler.schedule()  # a0..a2 decode, b0 decodes
    assert may_give_way(output, scheduler)


@pytest.fixture
def socket_pair():
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    context.term()


def add_frame(request_id: str, tenant: str) -> bytes:
    return encode(AddRequest(request_id, [5, 6, 7], SamplingParams(max_tokens=4), 0.0,
                             tenant=tenant))


def wait_for(pull: zmq.Socket) -> None:
    assert pull.poll(5000, zmq.POLLIN), "the frame never arrived"


def watch_until(watch: ArrivalWatch, count: int) -> bool:
    """Calls the watch until it holds `count` frames; whether any call said give way."""
    urgent = False
    deadline = time.monotonic() + 5
    while len(watch.held) < count:
        assert time.monotonic() < deadline, "frames never arrived"
        urgent = watch() or urgent
    return urgent


def flooded_scheduler():
    """Tenant a holds all 4 seats: over its share once another tenant comes."""
    scheduler = make_scheduler(max_num_seqs=4)
    for index in range(6):
        scheduler.add(make_request(f"a{index}", prompt_len=4, max_tokens=50, tenant="a"))
    run_step(scheduler)
    return scheduler


def test_the_watch_gives_way_to_a_tenant_under_its_share_and_keeps_every_frame(socket_pair):
    push, pull = socket_pair
    scheduler = flooded_scheduler()
    watch = ArrivalWatch(pull, lambda: scheduler)
    assert not watch()  # nothing arrived
    push.send(add_frame("a9", "a"))
    assert not watch_until(watch, 1)  # the flooding tenant's own request
    push.send(b"not a frame")
    assert not watch_until(watch, 2)  # left for the drain to report
    push.send(add_frame("b0", "b"))
    assert watch_until(watch, 3)
    assert [parts[0].bytes for parts in watch.take()] == [
        add_frame("a9", "a"), b"not a frame", add_frame("b0", "b")]
    assert watch.take() == []
