"""Fair share across tenants: weighted Virtual Token Counters (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024).

Each tenant has a counter of the service it received: the prompt tokens the engine computed
for it (PREFILL_TOKEN_COST each, charged when a request is first admitted; prefix-cache
hits cost nothing and recomputation after a preemption is not charged) plus its generated
tokens (DECODE_TOKEN_COST each), divided by its weight. The scheduler admits the waiting
request of the tenant with the smallest counter, and preempts from the tenant with the
largest. A tenant that comes back after a while with nothing waiting has its counter lifted
to the smallest counter among the tenants still waiting (or, when none waits, to the counter
of the tenant whose waiting requests ran out last), so idle time is never banked as credit.

Without tenants every request belongs to the one tenant "", and the order is plain FCFS.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.request import Request

# The paper's costs: an output token costs twice an input token (as API prices have it).
PREFILL_TOKEN_COST = 1.0
DECODE_TOKEN_COST = 2.0


@dataclass(slots=True)
class TenantAccount:
    name: str
    weight: float = 1.0
    counter: float = 0.0  # service received: tokens x cost / weight
    num_waiting: int = 0  # requests of this tenant in the scheduler's waiting queue


@dataclass(slots=True)
class FairShare:
    accounts: dict[str, TenantAccount] = field(default_factory=dict)
    last_to_leave: str | None = None  # the tenant whose waiting requests ran out last

    def counter(self, tenant: str) -> float:
        account = self.accounts.get(tenant)
        return 0.0 if account is None else account.counter

    @property
    def counter_of_last_to_leave(self) -> float:
        return 0.0 if self.last_to_leave is None else self.counter(self.last_to_leave)

    @property
    def num_waiting_tenants(self) -> int:
        return sum(1 for account in self.accounts.values() if account.num_waiting)

    def arrived(self, request: Request) -> None:
        """A new request joins the waiting queue; its tenant's weight is the one it carries."""
        account = self.accounts.get(request.tenant)
        if account is None:
            account = self.accounts[request.tenant] = TenantAccount(request.tenant)
        account.weight = request.tenant_weight
        if account.num_waiting == 0:
            waiting = [other.counter for other in self.accounts.values() if other.num_waiting]
            floor = min(waiting) if waiting else self.counter_of_last_to_leave
            account.counter = max(account.counter, floor)
        account.num_waiting += 1

    def requeued(self, request: Request) -> None:
        """A preempted request returns to the queue: its tenant was active all along."""
        self.accounts[request.tenant].num_waiting += 1

    def left_queue(self, request: Request) -> None:
        """Admitted, aborted or expired while waiting."""
        account = self.accounts[request.tenant]
        account.num_waiting -= 1
        if account.num_waiting == 0:
            self.last_to_leave = account.name

    def charge_prefill(self, request: Request, num_tokens: int) -> None:
        self._charge(request, num_tokens * PREFILL_TOKEN_COST)

    def charge_decode(self, request: Request, num_tokens: int) -> None:
        self._charge(request, num_tokens * DECODE_TOKEN_COST)

    def _charge(self, request: Request, cost: float) -> None:
        account = self.accounts[request.tenant]
        account.counter += cost / account.weight

    def pick_waiting(self, waiting: list[Request], running: list[Request]) -> Request:
        """The request to admit next: the first (in queue order) of the waiting tenant with
        the smallest counter; among equal counters (a returning tenant is lifted to the
        smallest waiting one) the tenant holding fewer seats, then queue order."""
        num_tenants = self.num_waiting_tenants
        if num_tenants <= 1:
            return waiting[0]
        heads: dict[str, Request] = {}
        for request in waiting:
            heads.setdefault(request.tenant, request)
            if len(heads) == num_tenants:
                break
        held = Counter(request.tenant for request in running)
        return min(heads.values(),
                   key=lambda request: (self.counter(request.tenant), held[request.tenant]))

    def seat_exchange(self, waiting: list[Request], running: list[Request],
                      seats: int) -> tuple[Request, Request] | None:
        """Every seat taken: (a waiting request, the running one to give it its seat), for
        the first waiting request of a tenant holding no seat at all (the one with the
        smallest counter, if several) whose weighted share of the seats (among the tenants
        with requests running or waiting) is at least one; the seat comes from the tenant
        furthest over its own share even without it, its most recently admitted request. So
        a light tenant starts at once beside a flooding one, and tenants that all hold seats
        share by admission order alone (no seat changes hands twice: no thrashing)."""
        heads: dict[str, Request] = {}
        for request in waiting:
            heads.setdefault(request.tenant, request)
        for head in sorted(heads.values(), key=lambda request: self.counter(request.tenant)):
            victim = self._seat_victim(head, running, seats)
            if victim is not None:
                return head, victim
        return None

    def _seat_victim(self, candidate: Request, running: list[Request],
                     seats: int) -> Request | None:
        held = Counter(request.tenant for request in running)
        active = {name for name, account in self.accounts.items()
                  if account.num_waiting or held[name]}
        if len(active) < 2:
            return None
        total = sum(self.accounts[name].weight for name in active)

        def share(name: str) -> float:
            return seats * self.accounts[name].weight / total

        if held[candidate.tenant] or share(candidate.tenant) < 1:
            return None
        over = [name for name in active
                if name != candidate.tenant and held[name] - 1 >= share(name)]
        if not over:
            return None
        furthest = max(over, key=lambda name: held[name] - share(name))
        return next(request for request in reversed(running) if request.tenant == furthest)

    def pick_victim(self, running: list[Request]) -> Request:
        """The request to preempt: of the running tenant furthest over its share (largest
        counter), the most recently admitted; among equal counters, the most recently
        admitted of them (with one tenant: the last of `running`, as without tenants)."""
        return max(reversed(running), key=lambda request: self.counter(request.tenant))
