"""Deadlines through the engine (tiny random model): a request past its deadline while
waiting gets an error and never runs; one past it while running ends with finish reason
timeout and the tokens it generated; no KV block stays taken either way."""

from __future__ import annotations

import pytest

from common.protocol import FinishReason, RequestError
from tests.engine_helpers import assert_no_leaks, greedy_request, make_core
from tests.model_fixtures import build_tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def push_past_deadline(core, request_id: str) -> None:
    """As if the request had reached the engine long ago: its deadline is behind us."""
    request = core.scheduler.requests[request_id]
    request.queued_at -= request.timeout_s + 1.0


def test_expiry_while_waiting_and_while_running_leaks_no_block(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_seqs=1)
    try:
        running = greedy_request(list(range(3, 40)), 100, "running")
        running.timeout_s = 30.0
        waiting = greedy_request(list(range(50, 90)), 10, "waiting")
        waiting.timeout_s = 30.0
        core.add_request(running)
        core.add_request(waiting)
        generated = []
        for _ in range(4):
            generated += [token for output in core.step().outputs
                          for token in output.new_token_ids]
        assert len(generated) == 4 and core.block_manager.num_free_blocks < \
            core.block_manager.num_blocks
        assert core.expire_deadlines() == ([], None)  # nothing is due yet

        push_past_deadline(core, "waiting")
        errors, finished = core.expire_deadlines()
        assert [(e.request_id, e.code) for e in errors] == [
            ("waiting", RequestError.DEADLINE_EXCEEDED)]
        assert "never started" in errors[0].reason and finished is None

        push_past_deadline(core, "running")
        errors, finished = core.expire_deadlines()
        assert errors == [] and finished is not None
        assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in finished.outputs] == [
            ("running", [], FinishReason.TIMEOUT)]
        assert not core.has_work
        assert_no_leaks(core)
        assert all(trace.scheduled.get("waiting") is None for trace in core.traces)
    finally:
        core.shutdown()
