"""One log line per interval while busy: throughput, queue sizes, KV usage, preemptions."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from common.protocol import StepStats

logger = logging.getLogger("loom.engine")


@dataclass(slots=True)
class StatsLogger:
    interval_s: float = 5.0
    window_started: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    step_times: list[float] = field(default_factory=list)

    def observe(self, stats: StepStats) -> None:
        self.prompt_tokens += stats.num_prompt_tokens
        self.generation_tokens += stats.num_generation_tokens
        self.step_times.append(stats.step_time_s)
        elapsed = time.monotonic() - self.window_started
        if elapsed >= self.interval_s:
            self._emit(stats, elapsed)

    def _emit(self, stats: StepStats, elapsed: float) -> None:
        step_ms = sorted(t * 1000 for t in self.step_times)
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | KV %.1f%% | "
            "preemptions %d | steps %d, step p50 %.1f ms, max %.1f ms",
            self.prompt_tokens / elapsed, self.generation_tokens / elapsed,
            stats.num_running, stats.num_waiting, stats.kv_cache_usage * 100,
            stats.num_preemptions_total, len(step_ms), statistics.median(step_ms), step_ms[-1])
        self.window_started = time.monotonic()
        self.prompt_tokens = self.generation_tokens = 0
        self.step_times.clear()
