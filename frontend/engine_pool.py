"""The engines behind one frontend: one EngineClient per data-parallel rank, and the router
that picks one for each API request (all its prompts and n choices go to that engine, so
an abort, a stream and a prefix all stay with one engine).

With several engines, one engine's death fails only the requests in flight there: the
others keep serving, and its client comes back when launch.py has restarted it (the new
process binds the same addresses). With one engine nothing changes: its death fails every
open stream and /health answers 503 until it is back.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.protocol import Ready
from frontend.disaggregation import PrefillDecodeRoute
from frontend.engine_client import EngineClient
from frontend.metrics import LoomMetrics
from frontend.request_stream import EngineDeadError
from frontend.router import Router, prefix_hashes

# vLLM's coordinator scores an engine as 4 x waiting + running.
WAITING_WEIGHT = 4


class EnginePool:
    def __init__(self, clients: list[EngineClient], router: Router,
                 metrics: LoomMetrics, kv_roles: list[str] | None = None) -> None:
        """`kv_roles`: each engine's role in prefill/decode disaggregation
        (frontend.disaggregation); None: every engine serves whole requests."""
        self.clients = clients
        self.router = router
        self.metrics = metrics
        self.kv_roles = kv_roles
        self._lives: dict[int, tuple[int, bool]] = {}  # rank: (restarts, dead) last seen
        for client in clients:
            client.peers_model = self.reported_info

    def start(self) -> None:
        for client in self.clients:
            client.start()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    @property
    def engine_dead(self) -> bool:
        """No engine serves."""
        return all(client.engine_dead for client in self.clients)

    @property
    def num_live(self) -> int:
        return sum(not client.engine_dead for client in self.clients)

    @property
    def num_waiting_estimate(self) -> int:
        return sum(client.num_waiting_estimate for client in self.clients
                   if not client.engine_dead)

    def fail_all(self, reason: str) -> None:
        for client in self.clients:
            client.fail_all(reason)

    def load(self, client: EngineClient) -> float | None:
        if client.engine_dead:
            return None
        return client.num_in_flight + (WAITING_WEIGHT - 1) * client.num_waiting_estimate

    def route(self, prompts: Sequence[Sequence[int]]) -> EngineClient | PrefillDecodeRoute:
        """The engine for one API request, or its prefill and decode engines while both
        kinds serve. Raises EngineDeadError when none serves."""
        self._notice_deaths()
        info = self.reported_info()
        if info is not None:  # engines all remote: the block size came with their READY
            self.router.block_size = info.block_size
        loads = [self.load(client) for client in self.clients]
        if self.kv_roles is not None:
            hashes = [prefix_hashes(prompt, self.router.block_size) for prompt in prompts]
            held_before = [[self.router.prefixes.num_blocks_held(h, rank)
                            for rank in range(len(self.clients))] for h in hashes]
            prefill = self._choose(prompts, loads, hashes, "prefill")
            decode = self._choose(prompts, loads, hashes, "decode")
            if prefill is not None and decode is not None and prefill is not decode:
                held = {tuple(prompt): blocks[decode.rank]
                        for prompt, blocks in zip(prompts, held_before, strict=True)}
                return PrefillDecodeRoute(prefill, decode, held)
        try:
            rank = self.router.choose(prompts, loads)
        except LookupError:
            raise EngineDeadError("no engine is running") from None
        return self.clients[rank]

    def _choose(self, prompts: Sequence[Sequence[int]], loads: list[float | None],
                hashes: list[list[int]], role: str) -> EngineClient | None:
        """The engine for one leg among the live engines of that role (or both), if any."""
        assert self.kv_roles is not None
        eligible = [load if self.kv_roles[rank] in (role, "both") else None
                    for rank, load in enumerate(loads)]
        if all(load is None for load in eligible):
            return None
        return self.clients[self.router.choose(prompts, eligible, hashes)]

    def _notice_deaths(self) -> None:
        """A dead or restarted engine holds no cached prefix: the router forgets its own."""
        for rank, client in enumerate(self.clients):
            life = (client.restarts, client.engine_dead)
            if life != self._lives.get(rank, (0, False)):
                self.router.prefixes.forget(rank)
                self._lives[rank] = life

    def reported_info(self) -> Ready | None:
        """What the engines serve: the first READY one of them sent (or launch.py's)."""
        return next((client.ready for client in self.clients if client.ready is not None),
                    None)

    def refresh_metrics(self) -> None:
        self.metrics.engines_live.set(self.num_live)
