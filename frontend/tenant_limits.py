"""Per-tenant limits: concurrent requests, and prompt / generated tokens per minute.

Token budgets are token buckets that hold one minute's budget and refill continuously
(budget / 60 per second), so a tenant may burst up to a minute's worth and then goes at its
rate. Prompt tokens (each prompt once, as `usage.prompt_tokens` counts them, prefix-cache hits
included) are taken when a request is admitted; a request needs as many in the bucket, or a
full bucket when it is larger than the whole budget. Generated tokens (every choice's, as
`usage.completion_tokens` counts them) are taken as they arrive and may overdraw the bucket: a
running request is never cut for it, but the tenant's next requests wait until it is positive.
Concurrency counts API requests (one, whatever `n`), from the moment the key is checked to
the end of the response.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from frontend.errors import APIError
from frontend.tenants import Tenant

Clock = Callable[[], float]


@dataclass(slots=True)
class TokenBucket:
    per_minute: int
    clock: Clock = time.monotonic
    level: float = field(init=False)
    updated_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = float(self.per_minute)
        self.updated_at = self.clock()

    @property
    def rate_per_s(self) -> float:
        return self.per_minute / 60.0

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.per_minute, self.level + (now - self.updated_at) * self.rate_per_s)
        self.updated_at = now

    def seconds_until(self, tokens: float) -> float:
        """How long until the bucket holds `tokens` (capped at its size); 0: now."""
        self._refill()
        wanted = min(tokens, self.per_minute)
        return max(wanted - self.level, 0.0) / self.rate_per_s

    def take(self, tokens: int) -> None:
        self._refill()
        self.level -= tokens


def retry_after_s(seconds: float) -> int:
    """Retry-After is whole seconds: rounded up, at least 1."""
    return max(1, math.ceil(seconds))


def rate_limited(tenant: str, limit: str, message: str, seconds: float) -> APIError:
    """OpenAI's rate-limit error: 429, type "requests" or "tokens", code rate_limit_exceeded."""
    return APIError(f"Rate limit reached for tenant {tenant!r} on {limit}: {message}",
                    status=429, type="requests" if limit == "max_concurrent_requests"
                    else "tokens", param=limit, code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after_s(seconds))})


@dataclass(slots=True)
class TenantUsage:
    """One tenant's limits and what it uses of them now."""

    tenant: Tenant
    clock: Clock = time.monotonic
    num_running: int = 0
    input_bucket: TokenBucket | None = None
    output_bucket: TokenBucket | None = None

    def __post_init__(self) -> None:
        if self.tenant.input_tokens_per_minute is not None:
            self.input_bucket = TokenBucket(self.tenant.input_tokens_per_minute, self.clock)
        if self.tenant.output_tokens_per_minute is not None:
            self.output_bucket = TokenBucket(self.tenant.output_tokens_per_minute, self.clock)

    def start(self) -> None:
        """A request begins: raises the 429 when the tenant is at its concurrency cap or has
        run out of either token budget."""
        name, cap = self.tenant.name, self.tenant.max_concurrent_requests
        if cap is not None and self.num_running >= cap:
            raise rate_limited(name, "max_concurrent_requests",
                               f"{self.num_running} requests are running (limit {cap}).", 1.0)
        if self.input_bucket is not None:
            wait = self.input_bucket.seconds_until(1)
            if wait > 0:
                raise rate_limited(name, "input_tokens_per_minute", "no prompt tokens left "
                                   f"of {self.input_bucket.per_minute} per minute.", wait)
        if self.output_bucket is not None:
            wait = self.output_bucket.seconds_until(1)
            if wait > 0:
                raise rate_limited(name, "output_tokens_per_minute", "no output tokens left "
                                   f"of {self.output_bucket.per_minute} per minute.", wait)
        self.num_running += 1

    def finish(self) -> None:
        self.num_running -= 1

    def take_prompt_tokens(self, tokens: int) -> None:
        """Raises the 429 when the bucket holds fewer (and is not full)."""
        if self.input_bucket is None:
            return
        wait = self.input_bucket.seconds_until(tokens)
        if wait > 0:
            raise rate_limited(self.tenant.name, "input_tokens_per_minute",
                               f"the prompt has {tokens} tokens; the budget is "
                               f"{self.input_bucket.per_minute} per minute.", wait)
        self.input_bucket.take(tokens)

    def generated(self, tokens: int) -> None:
        if self.output_bucket is not None:
            self.output_bucket.take(tokens)
