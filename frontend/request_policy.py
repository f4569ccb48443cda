"""What the server holds a request to, beyond its body: its tenant (--tenants) and its
deadline (the `X-Request-Timeout` header).

`X-Request-Timeout: SECONDS` (a positive number, at most a day) sets a deadline that many
seconds after the request arrived. A request still waiting in the engine's queue at its
deadline is dropped, never started (504, code deadline_exceeded; an error event when
streaming); one already generating is stopped there with what it generated, its
`finish_reason` "length" and `native_finish_reason` "timeout".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from aiohttp import web

from frontend.auth import bearer_token, is_protected
from frontend.errors import APIError, invalid_param
from frontend.tenant_gate import TenantGate
from frontend.tenant_limits import TenantUsage

TIMEOUT_HEADER = "X-Request-Timeout"
MAX_TIMEOUT_S = 86_400.0
# Where a tenant's concurrency cap and token budgets apply: the routes that generate.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                              "/v1/messages", "/v1/embeddings"})


@dataclass(slots=True)
class RequestPolicy:
    gate: TenantGate | None = None
    tenant: TenantUsage | None = None  # None: no --tenants
    deadline: float | None = None  # time.monotonic() by which it must be done
    timeout_s: float | None = None  # as the client asked

    @property
    def tenant_name(self) -> str:
        return "" if self.tenant is None else self.tenant.tenant.name

    @property
    def tenant_weight(self) -> float:
        return 1.0 if self.tenant is None else self.tenant.tenant.weight

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline; raises the 504 once it has passed."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise deadline_exceeded(f"The request's deadline ({self.timeout_s:g} s, "
                                    f"{TIMEOUT_HEADER}) passed before it reached the engine.")
        return left

    @property
    def within_share(self) -> bool:
        """Its tenant holds at most its weighted share of the open requests, among all the
        tenants of --tenants (False without): an overloaded queue still takes its request."""
        return self.gate is not None and self.tenant is not None \
            and self.gate.within_share(self.tenant)

    def take_prompt_tokens(self, tokens: int) -> None:
        if self.gate is not None and self.tenant is not None:
            self.gate.take_prompt_tokens(self.tenant, tokens)

    def generated(self, tokens: int) -> None:
        if self.gate is not None and self.tenant is not None:
            self.gate.generated(self.tenant, tokens)


POLICY = web.RequestKey("loom_request_policy", RequestPolicy)


def deadline_exceeded(message: str) -> APIError:
    return APIError(message, status=504, type="server_error", code="deadline_exceeded")


def policy_of(request: web.Request) -> RequestPolicy:
    return request.get(POLICY) or RequestPolicy()


def parse_timeout(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_TIMEOUT_S):
        raise invalid_param(TIMEOUT_HEADER, f"The {TIMEOUT_HEADER} header must be a number of "
                                            f"seconds above 0 and at most {MAX_TIMEOUT_S:g}, "
                                            f"got {value!r}.")
    return seconds


def request_policy_middleware(gate: TenantGate | None) -> web.middleware:
    """Reads the deadline; with tenants, also the key (401 unless it is a tenant's) and, on
    the generating routes, the tenant's concurrency and budgets (429), held until the
    response ends."""

    @web.middleware
    async def apply_policy(request: web.Request, handler) -> web.StreamResponse:
        arrival = time.monotonic()
        timeout_s = parse_timeout(request.headers.get(TIMEOUT_HEADER))
        policy = RequestPolicy(gate, deadline=None if timeout_s is None else arrival + timeout_s,
                               timeout_s=timeout_s)
        request[POLICY] = policy
        if gate is None or not is_protected(request.path):
            return await handler(request)
        key = bearer_token(request) or request.headers.get("x-api-key", "").strip()
        policy.tenant = gate.identify(key)
        if request.method != "POST" or request.path not in GENERATION_PATHS:
            return await handler(request)
        gate.start(policy.tenant)
        try:
            return await handler(request)
        finally:
            gate.finish(policy.tenant)

    return apply_policy
