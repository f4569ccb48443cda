"""Prometheus metrics under the `loom:` prefix, named as vLLM operators chart them.

Scheduler figures come from the stats every engine frame carries; request latencies are
measured here, per engine request (each of n choices counts). Every app has its own
registry, so several apps in one process (tests) never share series.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

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
    """A counter that follows totals the engines keep, each engine's own: it only ever moves
    forward, by the sum of the engines' advances."""

    def __init__(self, counter: Counter, per_engine: bool = False) -> None:
        self._counter = counter
        self._per_engine = per_engine  # the counter has an `engine` label
        self._last: dict[int, float] = {}

    def advance_to(self, total: float, engine: int = 0) -> None:
        if not math.isfinite(total):
            return
        last = self._last.get(engine, 0.0)
        if total > last:
            series = self._counter.labels(str(engine)) if self._per_engine else self._counter
            series.inc(total - last)
        # A total below the last one would mean a restarted engine: the series must not
        # go back, so the new engine's counting continues from here.
        self._last[engine] = total

    def restart(self, engine: int) -> None:
        """The engine's process is gone: its successor counts from zero."""
        self._last.pop(engine, None)


class LoomMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.num_requests_running = gauge("num_requests_running", "Requests the engines run.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests the engines queue.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc",
            "KV blocks in use, 0..1, mean over engines (evictable cached blocks are free).",
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.request_success = counter(
            "request_success_total", "Finished requests by finish reason.", ["finished_reason"]
        )
        self.requests_rejected = counter(
            "num_requests_rejected_total", "Requests refused with 503 (overload).", ["reason"]
        )
        self.connections_open = gauge("http_connections_open", "Open HTTP connections.")
        self.connections_closed = counter(
            "http_connections_closed_total", "HTTP connections the server closed on its own: "
            "keep_alive_timeout (idle), read_timeout (a request that did not arrive in time; "
            "408), max_connections (refused with 503).", ["reason"])
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
        self.prefix_cache_disk_hits = RunningTotal(counter(
            "prefix_cache_disk_hits_total", "Prompt tokens the prefix cache's disk tier "
            "supplied (also counted in prefix_cache_hits_total)."))
        self.prefix_cache_transfer_hits = RunningTotal(counter(
            "prefix_cache_transfer_hits_total", "Prompt tokens whose KV a prefill engine "
            "handed to a decode engine (also counted in prefix_cache_hits_total)."))
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes_total", "Bytes of KV blocks relayed from prefill engines to "
            "decode engines.")
        self.kv_offload = {name: RunningTotal(counter(name, help_text)) for name, help_text in (
            ("kv_offload_read_bytes_total", "Bytes of KV blocks read from the disk tier."),
            ("kv_offload_written_bytes_total", "Bytes of KV blocks written to the disk tier."),
            ("kv_offload_read_seconds_total", "Seconds spent reading the disk tier."),
            ("kv_offload_write_seconds_total", "Seconds the disk tier's writer spent "
                                               "writing (off the step loop)."))}
        self.kv_integrity_violations = RunningTotal(
            counter("kv_integrity_violations_total", "KV accounting errors the engine found.")
        )
        self.engine_bad_frames = RunningTotal(
            counter("engine_bad_frames_total", "Frontend frames the engine dropped as malformed.")
        )
        self.spec_drafts = RunningTotal(counter(
            "spec_decode_num_drafts", "Speculative verifications that carried drafts."))
        self.spec_draft_tokens = RunningTotal(counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."))
        self.spec_accepted_tokens = RunningTotal(counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."))
        self._spec_accepted_by_position = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
            "(0: the first draft of a verification).", ["position"])
        self._spec_positions: dict[int, RunningTotal] = {}
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
        self.engines_live = gauge("engines_live", "Engines serving (data-parallel ranks).")
        self.engine_restarts = counter("engine_restarts_total",
                                       "Engines that came back after they died.", ["engine"])
        # Per engine (data-parallel rank); the series above sum every engine's.
        labels = ["engine"]
        self.engine_running = self._gauge("engine_num_requests_running",
                                          "Requests this engine runs.", labels)
        self.engine_waiting = self._gauge("engine_num_requests_waiting",
                                          "Requests this engine queues.", labels)
        self.engine_kv_usage = self._gauge("engine_kv_cache_usage_perc",
                                           "This engine's KV blocks in use, 0..1.", labels)
        self.engine_at_rest = self._gauge(
            "engine_at_rest", "1 once this engine went idle and checked its KV accounting "
            "(kv_integrity_violations_total is current), 0 while it steps.", labels)
        self.engine_prompt_tokens = counter("engine_prompt_tokens_total",
                                            "Prompt tokens this engine computed.", labels)
        self.engine_generation_tokens = counter("engine_generation_tokens_total",
                                                "Tokens this engine generated.", labels)
        self.engine_prefix_cache_queries = RunningTotal(counter(
            "engine_prefix_cache_queries_total",
            "Prompt tokens looked up in this engine's prefix cache.", labels), per_engine=True)
        self.engine_prefix_cache_hits = RunningTotal(counter(
            "engine_prefix_cache_hits_total",
            "Prompt tokens found in this engine's prefix cache.", labels), per_engine=True)
        self._engine_stats: dict[int, StepStats] = {}
        self._engine_starts: dict[int, float] = {}  # each engine process's start time
        # Others that follow every engine frame's stats (frontend.deadline_admission).
        self.step_listeners: list[Callable[[StepStats, int], None]] = []

    def _gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(PREFIX + name, documentation, labels, registry=self.registry)

    def _counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, documentation, labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(PREFIX + name, documentation, buckets=buckets, registry=self.registry)

    def observe_step(self, stats: StepStats, engine: int = 0) -> None:
        """One engine's frame: its own series, and the sums over every engine's latest."""
        if self._engine_starts.setdefault(engine, stats.engine_start_time) \
                != stats.engine_start_time:
            self._new_engine_process(engine, stats.engine_start_time)
        self._engine_stats[engine] = stats
        self._set_sums()
        for listener in self.step_listeners:
            listener(stats, engine)
        prompt_tokens = max(stats.num_prompt_tokens, 0)
        generation_tokens = max(stats.num_generation_tokens, 0)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.preemptions.advance_to(stats.num_preemptions_total, engine)
        self.prefix_cache_queries.advance_to(stats.prefix_cache_queries_total, engine)
        self.prefix_cache_hits.advance_to(stats.prefix_cache_hits_total, engine)
        self.prefix_cache_disk_hits.advance_to(stats.prefix_cache_disk_hits_total, engine)
        self.prefix_cache_transfer_hits.advance_to(stats.prefix_cache_transfer_hits_total,
                                                   engine)
        for name, series in self.kv_offload.items():
            series.advance_to(getattr(stats, name), engine)
        self.kv_integrity_violations.advance_to(stats.kv_integrity_violations_total, engine)
        self.engine_bad_frames.advance_to(stats.bad_frames_total, engine)
        self._observe_spec(stats, engine)
        if stats.step_time_s > 0:  # the frame sent on going idle is not a step
            self.step_time.observe(stats.step_time_s)
        rank = str(engine)
        self.engine_running.labels(rank).set(stats.num_running)
        self.engine_waiting.labels(rank).set(stats.num_waiting)
        self.engine_kv_usage.labels(rank).set(stats.kv_cache_usage)
        self.engine_at_rest.labels(rank).set(int(stats.at_rest))
        self.engine_prompt_tokens.labels(rank).inc(prompt_tokens)
        self.engine_generation_tokens.labels(rank).inc(generation_tokens)
        self.engine_prefix_cache_queries.advance_to(stats.prefix_cache_queries_total, engine)
        self.engine_prefix_cache_hits.advance_to(stats.prefix_cache_hits_total, engine)

    def _observe_spec(self, stats: StepStats, engine: int) -> None:
        self.spec_drafts.advance_to(stats.spec_decode_num_drafts_total, engine)
        self.spec_draft_tokens.advance_to(stats.spec_decode_num_draft_tokens_total, engine)
        self.spec_accepted_tokens.advance_to(stats.spec_decode_num_accepted_tokens_total, engine)
        for position, total in enumerate(stats.spec_decode_accepted_by_position_total):
            series = self._spec_positions.get(position)
            if series is None:
                series = self._spec_positions[position] = RunningTotal(
                    self._spec_accepted_by_position.labels(str(position)))
            series.advance_to(total, engine)

    def _new_engine_process(self, engine: int, start_time: float) -> None:
        """A restarted engine (local or remote) counts its totals from zero: all of its
        first report's counts are new."""
        self._engine_starts[engine] = start_time
        for value in vars(self).values():
            for series in value.values() if isinstance(value, dict) else [value]:
                if isinstance(series, RunningTotal):
                    series.restart(engine)

    def engine_gone(self, engine: int) -> None:
        """A dead engine runs and queues nothing: the sums leave it out until it reports."""
        self._engine_stats.pop(engine, None)
        self._set_sums()
        self.engine_running.labels(str(engine)).set(0)
        self.engine_waiting.labels(str(engine)).set(0)
        with contextlib.suppress(KeyError):  # no report to wait for until it steps again
            self.engine_at_rest.remove(str(engine))

    def _set_sums(self) -> None:
        latest = self._engine_stats.values()
        self.num_requests_running.set(sum(s.num_running for s in latest))
        self.num_requests_waiting.set(sum(s.num_waiting for s in latest))
        usage = [s.kv_cache_usage for s in latest]
        self.kv_cache_usage_perc.set(sum(usage) / len(usage) if usage else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
