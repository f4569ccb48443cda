"""Prometheus metrics under the `loom:` prefix, named as vLLM operators chart them.

Scheduler figures come from the stats every engine frame carries; request latencies are
measured here, per engine request (each of n choices counts). Every app has its own
registry, so several apps in one process (tests) never share series.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.protocol import StepStats

PREFIX = "loom:"
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
                60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
               10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
               600.0, 1800.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 300.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)
# A 2,048-token prefill step takes seconds on a small CPU: the top buckets keep it measured.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5,
                1.0, 2.5, 5.0, 10.0, 30.0)
# fmt: on


class RunningTotal:
    """A counter that follows a total the engine keeps: it only ever moves forward."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._last = 0.0

    def advance_to(self, total: float) -> None:
        if not math.isfinite(total):
            return
        if total > self._last:
            self._counter.inc(total - self._last)
        # A total below the last one would mean a restarted engine: the series must not
        # go back, so the new engine's counting continues from here.
        self._last = total


class LoomMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.num_requests_running = gauge("num_requests_running", "Requests the engine runs.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests the engine queues.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV blocks in use, 0..1 (evictable cached blocks are free)."
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.request_success = counter(
            "request_success_total", "Finished requests by finish reason.", ["finished_reason"]
        )
        self.requests_rejected = counter(
            "num_requests_rejected_total", "Requests refused with 503 (overload).", ["reason"]
        )
        self.frontend_bad_frames = counter(
            "frontend_bad_frames_total", "Engine frames the frontend dropped as malformed."
        )
        self.preemptions = RunningTotal(
            counter("num_preemptions_total", "Requests preempted by the scheduler.")
        )
        self.prefix_cache_queries = RunningTotal(
            counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        )
        self.prefix_cache_hits = RunningTotal(
            counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        )
        self.kv_integrity_violations = RunningTotal(
            counter("kv_integrity_violations_total", "KV accounting errors the engine found.")
        )
        self.engine_bad_frames = RunningTotal(
            counter("engine_bad_frames_total", "Frontend frames the engine dropped as malformed.")
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Between consecutive output tokens.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Seconds from reaching the engine to first being scheduled.",
            QUEUE_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to finish.", E2E_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS
        )
        self.step_time = histogram("step_time_seconds", "Engine step duration.", STEP_BUCKETS)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(PREFIX + name, documentation, registry=self.registry)

    def _counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, documentation, labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(PREFIX + name, documentation, buckets=buckets, registry=self.registry)

    def observe_step(self, stats: StepStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.prompt_tokens.inc(max(stats.num_prompt_tokens, 0))
        self.generation_tokens.inc(max(stats.num_generation_tokens, 0))
        self.preemptions.advance_to(stats.num_preemptions_total)
        self.prefix_cache_queries.advance_to(stats.prefix_cache_queries_total)
        self.prefix_cache_hits.advance_to(stats.prefix_cache_hits_total)
        self.kv_integrity_violations.advance_to(stats.kv_integrity_violations_total)
        self.engine_bad_frames.advance_to(stats.bad_frames_total)
        if stats.step_time_s > 0:  # the frame sent on going idle is not a step
            self.step_time.observe(stats.step_time_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
