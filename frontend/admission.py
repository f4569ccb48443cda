"""Overload protection: a bound on requests waiting for the engines.

Waiting means sent to the engine and not yet running there (in flight minus the latest
stats' running count); each of a request's n choices counts. Past the bound a new
request is refused at once with 503 and Retry-After, and the admitted ones carry on. With
--tenants, a request of a tenant within its weighted share of the open requests is taken
even so: a tenant that floods the queue cannot shut the others out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.engine_pool import EnginePool
from frontend.errors import overloaded

DEFAULT_MAX_WAITING_REQUESTS = 1024
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class Admission:
    max_waiting: int = DEFAULT_MAX_WAITING_REQUESTS

    def admit(self, engine: EnginePool, num_choices: int, within_share: bool = False) -> None:
        """Raises the 503 APIError when the waiting queue has no room for num_choices and
        the request's tenant is not `within_share`.

        A request larger than the whole bound still runs when nothing waits, so it is
        never refused for ever.
        """
        waiting = engine.num_waiting_estimate
        if waiting == 0 or waiting + num_choices <= self.max_waiting or within_share:
            return
        engine.metrics.requests_rejected.labels(reason="overloaded").inc()
        raise overloaded(
            f"The server is overloaded: {waiting} requests are waiting (limit "
            f"{self.max_waiting}). Retry after {RETRY_AFTER_S} s.",
            RETRY_AFTER_S,
        )
