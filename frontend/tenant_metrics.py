"""Per-tenant Prometheus series (`tenant` label), registered only when --tenants is set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from frontend.metrics import PREFIX


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, names: list[str]) -> None:
        self.requests = Counter(PREFIX + "tenant_requests_total",
                                "API requests a tenant's key let in.", ["tenant"],
                                registry=registry)
        self.rejected = Counter(PREFIX + "tenant_requests_rejected_total",
                                "A tenant's requests refused with 429, by the limit they hit.",
                                ["tenant", "limit"], registry=registry)
        self.running = Gauge(PREFIX + "tenant_requests_running",
                             "A tenant's API requests in progress.", ["tenant"],
                             registry=registry)
        self.prompt_tokens = Counter(PREFIX + "tenant_prompt_tokens_total",
                                     "Prompt tokens a tenant's admitted requests carried.",
                                     ["tenant"], registry=registry)
        self.generation_tokens = Counter(PREFIX + "tenant_generation_tokens_total",
                                         "Tokens generated for a tenant.", ["tenant"],
                                         registry=registry)
        for name in names:  # every tenant's series exist from the start, at zero
            for family in (self.requests, self.running, self.prompt_tokens,
                           self.generation_tokens):
                family.labels(tenant=name)
