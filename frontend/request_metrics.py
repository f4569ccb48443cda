"""One engine request's latencies, observed as its outputs reach the frontend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from frontend.metrics import LoomMetrics

ERROR = "error"  # finished_reason label of a request the engine or the server failed


@dataclass(slots=True)
class RequestTimer:
    metrics: LoomMetrics
    arrival: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    finished: bool = False

    def tokens(self, count: int, step_time_s: float) -> None:
        """`count` tokens arrived together; the step that made them took step_time_s."""
        if count <= 0:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            ttft = now - self.arrival
            self.metrics.time_to_first_token.observe(ttft)
            # The first token's step holds (the end of) the prefill: before it, the
            # request waited.
            self.metrics.request_queue_time.observe(max(ttft - step_time_s, 0.0))
            count -= 1
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
        if reason != ERROR:
            self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)
