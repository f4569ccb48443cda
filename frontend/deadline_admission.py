"""--admission-control: refuse at once a request whose deadline the queue cannot meet.

The wait before a new request starts is estimated as the prompt tokens that will be served
before its own last prompt token, over the rate at which the engines have been computing
prompt tokens while requests waited (the last MAX_STEPS such steps; a stalled queue, whose
steps computed no prompt token, has a rate near zero). Under fair share the tokens before it
are its own tenant's waiting prompts and its own, plus, of every other tenant's waiting
prompts, as many as that tenant's weight lets it serve meanwhile; without tenants, every
waiting prompt. When that wait reaches the deadline the answer is a 503 with Retry-After
(the wait beyond the deadline). Without measured steps nothing is refused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.protocol import AddRequest, StepStats
from frontend.errors import SERVICE_UNAVAILABLE, APIError
from frontend.tenant_limits import retry_after_s

MAX_STEPS = 256
MIN_MEASURED_STEPS = 4


@dataclass(frozen=True, slots=True)
class PendingPrompt:
    tenant: str
    weight: float
    num_tokens: int


@dataclass(slots=True)
class QueueEstimate:
    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_STEPS))
    pending: dict[str, PendingPrompt] = field(default_factory=dict)  # sent, nothing back yet

    def observe_step(self, stats: StepStats, engine: int = 0) -> None:
        if stats.step_time_s > 0 and stats.num_waiting > 0:
            self.steps.append((stats.num_prompt_tokens, stats.step_time_s))

    @property
    def prompt_tokens_per_s(self) -> float | None:
        if len(self.steps) < MIN_MEASURED_STEPS:
            return None
        tokens = sum(num_tokens for num_tokens, _ in self.steps)
        seconds = sum(step_time for _, step_time in self.steps)
        return max(tokens, 1) / seconds

    def sent(self, request: AddRequest) -> None:
        self.pending[request.request_id] = PendingPrompt(
            request.tenant, request.tenant_weight, len(request.prompt_token_ids))

    def started(self, request_id: str) -> None:
        """Its first output came back (or it ended): it no longer waits."""
        self.pending.pop(request_id, None)

    def tokens_ahead(self, prompt: PendingPrompt) -> float:
        waiting: dict[str, float] = {}
        weights: dict[str, float] = {}
        for pending in self.pending.values():
            waiting[pending.tenant] = waiting.get(pending.tenant, 0) + pending.num_tokens
            weights[pending.tenant] = pending.weight
        own = waiting.pop(prompt.tenant, 0) + prompt.num_tokens
        return own + sum(min(tokens, own * weights[tenant] / prompt.weight)
                         for tenant, tokens in waiting.items())

    def wait_s(self, prompt: PendingPrompt) -> float | None:
        rate = self.prompt_tokens_per_s
        return None if rate is None else self.tokens_ahead(prompt) / rate

    def check(self, prompt: PendingPrompt, timeout_s: float | None) -> None:
        """Raises the 503 when the estimated wait reaches the deadline."""
        if timeout_s is None:
            return
        wait = self.wait_s(prompt)
        if wait is not None and wait >= timeout_s:
            raise APIError(f"The request cannot start within its deadline of {timeout_s:g} s: "
                           f"the queue ahead of it needs about {wait:.1f} s.", status=503,
                           type=SERVICE_UNAVAILABLE, code="deadline_unattainable",
                           headers={"Retry-After": str(retry_after_s(wait - timeout_s))})
