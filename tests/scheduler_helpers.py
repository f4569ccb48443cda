"""Drive the pure-Python scheduler without a model: every sampled token is a fixed non-EOS id."""

from __future__ import annotations

from common.config import EngineConfig
from common.sampling import SamplingParams
from engine.block_manager import BlockManager
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerOutput

EOS = 0
FILLER_TOKEN = 7


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 1024,
                   **config_overrides) -> Scheduler:
    config = EngineConfig(model="unused", block_size=block_size, **config_overrides)
    return Scheduler(config, BlockManager(num_blocks, block_size), max_model_len, [EOS])


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0,
                 **sampling) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return Request(request_id, list(range(1, prompt_len + 1)), params, priority=priority)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {chunk.request.request_id: FILLER_TOKEN
               for chunk in output.chunks if chunk.completes_sequence}
    scheduler.update(output, sampled)
    assert scheduler.block_manager.check_integrity(scheduler.live_requests) == []
    return output


def run_until_idle(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_work:
        outputs.append(run_step(scheduler))
        assert len(outputs) < max_steps, "scheduler made no progress"
    return outputs
