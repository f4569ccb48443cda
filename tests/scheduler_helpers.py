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
    manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
    return Scheduler(config, manager, max_model_len, [EOS])


def distinct_prompt(request_id: str, length: int) -> list[int]:
    """Token ids unique to the request id, so prompts share no prefix-cache blocks."""
    salt = sum(ord(char) * 31**i for i, char in enumerate(request_id)) % 100_000
    return [1000 + salt * 1000 + i for i in range(length)]


def make_request(request_id: str, prompt_len: int = 0, max_tokens: int = 4, priority: int = 0,
                 prompt: list[int] | None = None, tenant: str = "", tenant_weight: float = 1.0,
                 timeout_s: float | None = None, **sampling) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    tokens = prompt if prompt is not None else distinct_prompt(request_id, prompt_len)
    return Request(request_id, tokens, params, priority=priority, tenant=tenant,
                   tenant_weight=tenant_weight, timeout_s=timeout_s)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {chunk.request.request_id: [FILLER_TOKEN]
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
