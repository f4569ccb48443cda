"""What one benchmark run measured: per-request records and the run's summary metrics.

Definitions follow the usual serving benchmarks:
- TTFT: request sent -> first chunk carrying output text.
- ITL: gap between consecutive chunks carrying output text.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one token.
- E2E: request sent -> stream finished.
- Goodput: requests per second that met every SLO given.
Output tokens are counted by re-encoding the output text with the model's tokenizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    max_tokens: int
    start: float = 0.0  # perf_counter seconds
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks carrying output text
    texts: list[str] = field(default_factory=list)
    success: bool = False
    error: str | None = None
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    output_tokens: int = 0  # filled after the run, from the tokenizer

    @property
    def output_text(self) -> str:
        return "".join(self.texts)

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def summary(self, origin: float) -> dict[str, Any]:
        """JSON form, times relative to the run's start."""
        return {
            "success": self.success,
            "error": self.error,
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "usage_output_tokens": self.usage_output_tokens,
            "start_s": self.start - origin,
            "latency_s": self.latency if self.success else None,
            "ttft_s": self.ttft,
            "itls_s": self.itls,
        }


@dataclass(slots=True)
class Distribution:
    """Milliseconds; None when nothing was measured."""

    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution:
        if not values:
            return cls()
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99, float(ms.max()))


@dataclass(slots=True)
class Slo:
    """Service-level objectives in milliseconds, parsed from `ttft=500,tpot=50`."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        slo = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name not in SLO_METRICS or not value:
                raise ValueError(f"bad SLO {item!r}: expected NAME=MS with NAME one of "
                                 f"{', '.join(SLO_METRICS)}")
            setattr(slo, name, float(value))
        return slo

    def met_by(self, record: RequestRecord) -> bool:
        measured = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
        for name in SLO_METRICS:
            limit = getattr(self, name)
            value = measured[name]
            # A single-token answer has no TPOT, so it cannot miss a TPOT objective.
            if limit is not None and value is not None and value * 1000.0 > limit:
                return False
        return True


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_output_tokens_usage: int | None  # the server's own count, when it streamed usage
    output_token_mismatches: int | None  # requests whose two counts differ
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency_seen: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    slo: Slo | None
    goodput_requests: int | None
    goodput_request_throughput: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(records: list[RequestRecord], duration_s: float,
                    slo: Slo | None = None) -> BenchmarkMetrics:
    done = [record for record in records if record.success]
    input_tokens = sum(record.prompt_len for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    usage_known = bool(done) and all(r.usage_output_tokens is not None for r in done)
    good = sum(slo.met_by(record) for record in done) if slo is not None else None
    span = duration_s if duration_s > 0 else float("inf")
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        total_output_tokens_usage=(sum(r.usage_output_tokens for r in done)
                                   if usage_known else None),
        output_token_mismatches=(sum(r.usage_output_tokens != r.output_tokens for r in done)
                                 if usage_known else None),
        request_throughput=len(done) / span,
        output_throughput=output_tokens / span,
        total_token_throughput=(input_tokens + output_tokens) / span,
        max_concurrency_seen=max_overlap(done),
        ttft_ms=Distribution.of_seconds([r.ttft for r in done if r.ttft is not None]),
        tpot_ms=Distribution.of_seconds([r.tpot for r in done if r.tpot is not None]),
        itl_ms=Distribution.of_seconds([gap for r in done for gap in r.itls]),
        e2el_ms=Distribution.of_seconds([r.latency for r in done]),
        slo=slo,
        goodput_requests=good,
        goodput_request_throughput=good / span if good is not None else None,
    )


def concurrency_steps(records: list[RequestRecord]) -> list[tuple[float, int]]:
    """(time, requests in flight from then on), at every start and end."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    steps, level = [], 0
    for time, change in events:
        level += change
        steps.append((time, level))
    return steps


def max_overlap(records: list[RequestRecord]) -> int:
    return max((level for _, level in concurrency_steps(records)), default=0)


# The server's own view, from its Prometheus `/metrics` text (Loom's names start `loom:`).

LOOM_PREFIX = "loom:"
STEP_TIME_FAMILY = "loom:step_time_seconds"
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


@dataclass(slots=True)
class PrometheusSnapshot:
    samples: dict[str, float]  # "name{labels}" -> value
    types: dict[str, str]  # family -> counter | gauge | histogram | summary | untyped

    def kind(self, sample_name: str) -> str:
        if sample_name in self.types:
            return self.types[sample_name]
        for suffix in _SUFFIXES:
            if sample_name.endswith(suffix):
                family = sample_name.removesuffix(suffix)
                if family in self.types:
                    return self.types[family]
        return "counter" if sample_name.endswith("_total") else "untyped"


def parse_prometheus(text: str, prefix: str = LOOM_PREFIX) -> PrometheusSnapshot:
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4 and parts[2].startswith(prefix):
                types[parts[2]] = parts[3]
            continue
        if not line.startswith(prefix):
            continue
        # Label values may hold spaces: split after the closing brace when there is one.
        closing = line.rfind("}")
        split_at = closing + 1 if closing >= 0 else line.find(" ")
        key, rest = line[:split_at], line[split_at:].split()
        try:
            samples[key] = float(rest[0])
        except (IndexError, ValueError):
            continue
    return PrometheusSnapshot(samples, types)


def sample_name(key: str) -> str:
    return key.split("{", 1)[0]


def server_counters(before: PrometheusSnapshot, after: PrometheusSnapshot) -> dict[str, Any]:
    """Counter increases over the run and gauge values at its end; histograms left out."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for key, value in after.samples.items():
        name = sample_name(key)
        kind = after.kind(name)
        if name.endswith("_created"):
            continue
        if kind == "counter":
            counters[key] = value - before.samples.get(key, 0.0)
        elif kind in ("gauge", "untyped"):
            gauges[key] = value
    return {"counters": counters, "gauges": gauges}


@dataclass(slots=True)
class HistogramView:
    """A histogram's increase over the run; quantiles interpolated inside buckets."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    buckets: list[tuple[float, int]]  # (upper bound in seconds, observations in this bucket)

    def to_dict(self) -> dict[str, Any]:
        """JSON has no infinity: the last bound is written as Prometheus writes it."""
        return asdict(self) | {"buckets": [
            ["+Inf" if bound == float("inf") else bound, count] for bound, count in self.buckets
        ]}


def histogram_view(before: PrometheusSnapshot | None, after: PrometheusSnapshot,
                   family: str = STEP_TIME_FAMILY) -> HistogramView | None:
    cumulative = _bucket_increase(before, after, family)
    if not cumulative:
        return None
    count = int(cumulative[-1][1])
    total_s = _sum_of(after, family) - (_sum_of(before, family) if before else 0.0)
    per_bucket, previous = [], 0.0
    for bound, running in cumulative:
        per_bucket.append((bound, int(running - previous)))
        previous = running
    quantiles = [_quantile(cumulative, q) if count else None for q in (0.5, 0.9, 0.99)]
    return HistogramView(
        count=count,
        mean_ms=total_s / count * 1000.0 if count else None,
        p50_ms=quantiles[0], p90_ms=quantiles[1], p99_ms=quantiles[2],
        buckets=per_bucket,
    )


def _bucket_increase(before: PrometheusSnapshot | None, after: PrometheusSnapshot,
                     family: str) -> list[tuple[float, float]]:
    """Cumulative counts per upper bound, summed over label sets, ascending."""
    by_bound: dict[float, float] = {}
    for key, value in after.samples.items():
        if sample_name(key) != f"{family}_bucket" or 'le="' not in key:
            continue
        bound = float(key.split('le="', 1)[1].split('"', 1)[0])
        earlier = before.samples.get(key, 0.0) if before else 0.0
        by_bound[bound] = by_bound.get(bound, 0.0) + value - earlier
    return sorted(by_bound.items())


def _sum_of(snapshot: PrometheusSnapshot, family: str) -> float:
    return sum(value for key, value in snapshot.samples.items()
               if sample_name(key) == f"{family}_sum")


def _quantile(cumulative: list[tuple[float, float]], q: float) -> float:
    """Milliseconds, as Prometheus' histogram_quantile estimates it."""
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, running in cumulative:
        if running >= rank:
            if bound == float("inf"):
                return lower_bound * 1000.0
            share = (rank - lower_count) / (running - lower_count) if running > lower_count else 1
            return (lower_bound + (bound - lower_bound) * share) * 1000.0
        lower_bound, lower_count = bound, running
    return lower_bound * 1000.0
