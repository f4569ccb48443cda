"""The tenants' door: which tenant a key is, and whether it may start a request now."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from frontend.errors import APIError, unauthorized
from frontend.tenant_limits import Clock, TenantUsage
from frontend.tenant_metrics import TenantMetrics
from frontend.tenants import TenantTable


@dataclass(slots=True)
class TenantGate:
    table: TenantTable
    metrics: TenantMetrics
    clock: Clock = time.monotonic
    usage: dict[str, TenantUsage] = field(default_factory=dict)

    @classmethod
    def create(cls, table: TenantTable, registry: CollectorRegistry,
               clock: Clock = time.monotonic) -> TenantGate:
        gate = cls(table, TenantMetrics(registry, [t.name for t in table.tenants]), clock)
        gate.usage = {tenant.name: TenantUsage(tenant, clock) for tenant in table.tenants}
        return gate

    def identify(self, key: str | None) -> TenantUsage:
        """The key's tenant, or the 401."""
        if not key:
            raise unauthorized("Missing API key: send it as an 'Authorization: Bearer <key>' "
                               "header (or 'x-api-key: <key>').")
        tenant = self.table.for_key(key)
        if tenant is None:
            raise unauthorized("Incorrect API key provided.")
        return self.usage[tenant.name]

    def start(self, usage: TenantUsage) -> None:
        """Raises the 429 (counted) when the tenant may not start a request now."""
        name = usage.tenant.name
        try:
            usage.start()
        except APIError as error:
            self.rejected(name, error)
            raise
        self.metrics.requests.labels(tenant=name).inc()
        self.metrics.running.labels(tenant=name).set(usage.num_running)

    def within_share(self, usage: TenantUsage) -> bool:
        """The tenant's open requests (this one counted) are at most its weighted share of
        all open requests, shared among every tenant of the table."""
        total_weight = sum(other.tenant.weight for other in self.usage.values())
        total = sum(other.num_running for other in self.usage.values())
        return usage.num_running * total_weight <= total * usage.tenant.weight

    def finish(self, usage: TenantUsage) -> None:
        usage.finish()
        self.metrics.running.labels(tenant=usage.tenant.name).set(usage.num_running)

    def take_prompt_tokens(self, usage: TenantUsage, tokens: int) -> None:
        try:
            usage.take_prompt_tokens(tokens)
        except APIError as error:
            self.rejected(usage.tenant.name, error)
            raise
        self.metrics.prompt_tokens.labels(tenant=usage.tenant.name).inc(tokens)

    def generated(self, usage: TenantUsage, tokens: int) -> None:
        usage.generated(tokens)
        self.metrics.generation_tokens.labels(tenant=usage.tenant.name).inc(tokens)

    def rejected(self, name: str, error: APIError) -> None:
        self.metrics.rejected.labels(tenant=name, limit=error.param or "unknown").inc()
