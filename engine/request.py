"""A request in the engine: WAITING -> RUNNING -> FINISHED; a preempted one returns to WAITING."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from common.protocol import FinishReason
from common.sampling import SamplingParams

if TYPE_CHECKING:  # engine.sampling.grammar needs torch; a request stays pure Python
    from engine.sampling.grammar import Constraint


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    tenant: str = ""  # whose fair share it counts against (engine.fair_share)
    tenant_weight: float = 1.0
    timeout_s: float | None = None  # the deadline, counted from reaching the engine
    arrival_order: int = 0  # set by the scheduler: FCFS tie-break
    last_step: int = 0  # the scheduler step that last ran it (rows taken in turns)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output, in order
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV cache group
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    queued_at: float = field(default_factory=time.monotonic)  # reached the engine
    queue_time_s: float | None = None  # until first scheduled; preemption does not reset it
    output_token_counts: Counter[int] = field(default_factory=Counter)  # for penalties
    constraint: Constraint | None = None  # its grammars' matchers when constrained
    draft_token_ids: list[int] = field(default_factory=list)  # speculated for this step

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def deadline(self) -> float | None:
        """time.monotonic() past which it must not run on; None: no deadline."""
        return None if self.timeout_s is None else self.queued_at + self.timeout_s

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the one freshly sampled token still lacks K/V: prompt (or recompute) work."""
        return self.num_uncomputed_tokens > 1

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_counts[token_id] += 1
        if self.constraint is not None:
            self.constraint.consume_token(token_id)

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def check_stop(self, eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
        """The finish reason after the latest sampled token, or None to keep going."""
        last = self.token_ids[-1]
        sampling = self.sampling
        may_stop = self.num_output_tokens > sampling.min_tokens  # the sampler masks stops before
        if may_stop and not sampling.ignore_eos and last in eos_token_ids:
            return FinishReason.STOP
        if may_stop and last in sampling.stop_token_ids:
            return FinishReason.STOP
        if self.constraint is not None and self.constraint.is_stopped():
            return FinishReason.STOP  # the grammar is complete (or, never here, in error)
        if self.num_output_tokens >= sampling.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None


def deadline_passed(request: Request) -> str:
    """Why a request that never started was dropped."""
    return (f"its deadline passed while it waited in the engine's queue ({request.timeout_s:g} s "
            f"after it reached the engine); it was never started")
