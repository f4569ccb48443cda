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

Seats (max_num_seqs) are shared by weight as well (`SeatShares`): a tenant under its share
of them is admitted before those at or over it, and takes a seat from the tenant furthest
over its share when none is free, so a light tenant's request does not wait for a flooding
tenant's requests to finish.

While tenants contend (two or more with requests, one holding more than its share of the
seats), steps are kept short for the others (engine.scheduler, engine.give_way): a waiting
request of a tenant under its share starts in a step of its own (the rows of tenants over
their share wait that one step), the step under way gives way to it where it can, and a step
runs at most `fair_step_rows` running requests: each tenant within its share its share of
them, the others least recently run first. A light tenant's request so waits for no step
of every seat's decode: on a CPU a step's time grows with its rows.

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

    def pick_waiting(self, waiting: list[Request], running: list[Request],
                     seats: int) -> Request:
        """The request to admit next: the first (in queue order) of a waiting tenant, those
        under their share of the seats (`SeatShares`) before the others, then the smallest
        counter; among equal counters (a returning tenant is lifted to the smallest waiting
        one) the tenant holding fewer seats, then queue order."""
        num_tenants = self.num_waiting_tenants
        if num_tenants <= 1:
            return waiting[0]
        heads: dict[str, Request] = {}
        for request in waiting:
            heads.setdefault(request.tenant, request)
            if len(heads) == num_tenants:
                break
        seat_shares = SeatShares.of(self, running, seats)
        return min(heads.values(), key=lambda request: (
            not seat_shares.can_take(request.tenant), self.counter(request.tenant),
            seat_shares.held[request.tenant]))

    def seat_for(self, request: Request, running: list[Request], seats: int) -> Request | None:
        """Every seat taken and `request` next (`pick_waiting`): the running request to give
        it its seat where its tenant is under its share; the seat comes from the tenant
        furthest over its own share even without it, its most recently admitted request.
        So a light tenant's request starts at once beside a flooding tenant, not when a seat
        frees; no seat changes hands twice (the giver stays at or over its share, the taker
        at or under), and tenants under their share take free seats first: a seat taken
        from a tenant was not given to it in the same step."""
        seat_shares = SeatShares.of(self, running, seats)
        if not seat_shares.can_take(request.tenant):
            return None
        over = [name for name in seat_shares.active
                if name != request.tenant and seat_shares.can_give(name)]
        if not over:
            return None
        furthest = max(over, key=seat_shares.excess)
        return next(other for other in reversed(running) if other.tenant == furthest)

    def tenants_to_start_first(self, running: list[Request], seats: int) -> set[str]:
        """Tenants under their share of the seats with requests waiting, while another holds
        more than its share: their requests start in a step of their own."""
        if self.num_waiting_tenants == 0:
            return set()
        seat_shares = SeatShares.of(self, running, seats)
        return {name for name in seat_shares.active
                if self.accounts[name].num_waiting and seat_shares.starts_first(name)}

    def starts_first(self, tenant: str, weight: float, running: list[Request],
                     seats: int) -> bool:
        """Whether a request of `tenant` queued now would start in a step of its own."""
        return SeatShares.of(self, running, seats, (tenant, weight)).starts_first(tenant)

    def rows_left_out(self, running: list[Request], seats: int, limit: int) -> set[int]:
        """While tenants contend, the running requests (by id()) beyond a step of `limit`
        rows: first each tenant within its share of the seats its share of the step's rows
        (its least recently run), then the others by how recently they ran (so none waits
        more than about len(running) / limit steps); without contention, none."""
        if len(running) <= limit:
            return set()
        seat_shares = SeatShares.of(self, running, seats)
        if len(seat_shares.active) <= 1:
            return set()
        by_recency = sorted(running, key=lambda request: request.last_step)
        quota = {name: int(limit * weight / seat_shares.total_weight)
                 for name, weight in seat_shares.weights.items()
                 if seat_shares.excess(name) <= 0}
        first = []
        for request in by_recency:
            if quota.get(request.tenant, 0) > 0:
                quota[request.tenant] -= 1
                first.append(request)
        chosen = {id(request) for request in first}
        order = first + [request for request in by_recency if id(request) not in chosen]
        return {id(request) for request in order[limit:]}

    def pick_victim(self, running: list[Request]) -> Request:
        """The request to preempt: of the running tenant furthest over its share (largest
        counter), the most recently admitted; among equal counters, the most recently
        admitted of them (with one tenant: the last of `running`, as without tenants)."""
        return max(reversed(running), key=lambda request: self.counter(request.tenant))


@dataclass(slots=True)
class SeatShares:
    """The seats each tenant holds, against its weighted share of them among the tenants
    with requests running or waiting (with one such tenant, nothing is anyone's to take)."""

    seats: int
    held: Counter[str]
    weights: dict[str, float]  # of the tenants with requests running or waiting

    @classmethod
    def of(cls, fair_share: FairShare, running: list[Request], seats: int,
           arriving: tuple[str, float] | None = None) -> SeatShares:
        """`arriving`: the tenant and weight of a request not yet queued, counted as
        waiting."""
        held = Counter(request.tenant for request in running)
        weights = {name: account.weight for name, account in fair_share.accounts.items()
                   if account.num_waiting or held[name]}
        if arriving is not None:
            tenant, weight = arriving
            weights[tenant] = weight
        return cls(seats, held, weights)

    @property
    def active(self) -> set[str]:
        return set(self.weights)

    @property
    def total_weight(self) -> float:
        return sum(self.weights.values())

    @property
    def anyone_over(self) -> bool:
        return any(self.excess(name) > 0 for name in self.weights)

    def share(self, tenant: str) -> float:
        return self.seats * self.weights[tenant] / self.total_weight

    def can_take(self, tenant: str) -> bool:
        """One more seat keeps the tenant within its share."""
        return len(self.weights) > 1 and self.held[tenant] + 1 <= self.share(tenant)

    def starts_first(self, tenant: str) -> bool:
        """The tenant's next request starts in a step of its own: it is under its share
        while another holds more than theirs."""
        return self.anyone_over and self.can_take(tenant)

    def can_give(self, tenant: str) -> bool:
        """One seat fewer keeps the tenant at or over its share."""
        return len(self.weights) > 1 and self.held[tenant] - 1 >= self.share(tenant)

    def excess(self, tenant: str) -> float:
        return self.held[tenant] - self.share(tenant)
