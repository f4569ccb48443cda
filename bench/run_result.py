"""One benchmark run's settings (`ServeConfig`) and outcome (`RunResult`): what bench.serve
measures, bench.compare collects and bench.plots draws."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from bench.datasets import DatasetSpec
from bench.metrics import BenchmarkMetrics, HistogramView, RequestRecord, Slo

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass(slots=True)
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS_ENDPOINT
    model: str | None = None  # None: the first id of /v1/models
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    include_usage: bool = True
    slo: Slo | None = None
    warmup: bool = True
    progress: bool = True
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")
        if self.endpoint not in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT):
            raise ValueError(f"endpoint must be {COMPLETIONS_ENDPOINT} or {CHAT_ENDPOINT}")
        if self.burstiness <= 0 or self.request_rate <= 0:
            raise ValueError("request rate and burstiness must be positive")

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT_ENDPOINT


@dataclass(slots=True)
class RunResult:
    config: ServeConfig
    dataset: DatasetSpec
    metrics: BenchmarkMetrics
    records: list[RequestRecord]
    origin: float  # perf_counter at the benchmark's start
    server: dict[str, Any] | None  # None: no /metrics
    step_time: HistogramView | None  # None: no step-time histogram in /metrics
    accounting_s: float  # time spent counting output tokens, after the run
    date: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def errors(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self.records:
            if not record.success:
                counts[record.error or "unknown"] = counts.get(record.error or "unknown", 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["request_rate"] = "inf" if math.isinf(self.config.request_rate) else \
            self.config.request_rate
        return {
            "date": self.date,
            "config": config,
            "dataset": asdict(self.dataset) | {"prompts_file": str(self.dataset.prompts_file)},
            **self.metrics.to_dict(),
            "errors": self.errors(),
            "server_metrics": self.server,
            "step_time": self.step_time.to_dict() if self.step_time else None,
            "accounting_s": self.accounting_s,
            "requests": [record.summary(self.origin) for record in self.records],
        }
