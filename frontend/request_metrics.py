"""One engine request's latencies, observed as its outputs reach the frontend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from frontend.metrics import LoomMetrics

ERROR = "error"  # finished_reason label of a request the engine or the server failed


@dataclass(slots=True)
class RequestTimer:
    metrics: LoomMetrics
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0
    finished: bool = False

    def tokens(self, count: int, queue_time_s: float | None) -> None:
        """`count` tokens arrived together; the engine reports queue_time_s with the first."""
        if count <= 0:
            return
        now = time.monotonic()
        self.num_generated += count
        if self.last_token_at is None:
            self.first_token_at = now
            self.metrics.time_to_first_token.observe(now - self.arrival)
            if queue_time_s is not None:
                self.metrics.request_queue_time.observe(queue_time_s)
            count -= 1
            gap = 0.0  # the first token's companions came with it
        else:
            # Tokens that queued up behind a busy consumer share the gap evenly.
            gap = (now - self.last_token_at) / count
        for _ in range(count):
            self.metrics.inter_token_latency.observe(gap)
        self.last_token_at = now

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        self.metrics.request_success.labels(finished_reason=reason).inc()
        if reason == ERROR:
            return
        now = time.monotonic()
        self.metrics.e2e_request_latency.observe(now - self.arrival)
        if self.first_token_at is not None:
            self.metrics.request_decode_time.observe(now - self.first_token_at)
        self.metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        self.metrics.request_generation_tokens.observe(self.num_generated)
