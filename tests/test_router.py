"""The data-parallel router (frontend/router.py), pure Python: prefix affinity within a load
bound, least load with turns among equals, round robin, dead engines skipped."""

from __future__ import annotations

import pytest

from frontend.disaggregation import PrefillDecodeRoute
from frontend.engine_pool import EnginePool
from frontend.metrics import LoomMetrics
from frontend.router import OVERLOAD_SLACK, Router, prefix_hashes

BLOCK = 4
SHARED = list(range(100, 116))  # four whole blocks


def test_prefix_hashes_name_whole_blocks_and_chain() -> None:
    assert prefix_hashes([1, 2, 3], BLOCK) == []
    first = prefix_hashes([1, 2, 3, 4, 5], BLOCK)
    assert len(first) == 1
    assert prefix_hashes([1, 2, 3, 4, 9, 9, 9, 9], BLOCK)[0] == first[0]
    # The same block after a different prefix is a different entry.
    assert prefix_hashes([0, 0, 0, 0, 1, 2, 3, 4], BLOCK)[1] != first[0]


def test_idle_engines_take_turns_and_the_least_loaded_wins() -> None:
    router = Router("load", BLOCK)
    assert [router.choose([[i]], [0, 0]) for i in range(4)] == [0, 1, 0, 1]
    assert router.choose([[9]], [5, 2]) == 1


def test_a_prompt_goes_back_to_the_engine_that_holds_its_prefix() -> None:
    router = Router("cache_aware", BLOCK)
    holder = router.choose([[*SHARED, 1]], [0, 0])
    for tail in range(2, 6):  # the holder is busier, but within the bound
        assert router.choose([[*SHARED, tail]], [3 if r == holder else 0 for r in (0, 1)]) == holder
    other = 1 - holder
    assert router.choose([[7] * 16], [1 if r == holder else 0 for r in (0, 1)]) == other


def test_an_overloaded_holder_spills_to_the_least_loaded() -> None:
    router = Router("cache_aware", BLOCK)
    holder = router.choose([SHARED], [0, 0])
    loads = [0.0, 0.0]
    loads[holder] = OVERLOAD_SLACK + 1
    spilled = router.choose([[*SHARED, 1]], loads)
    assert spilled == 1 - holder
    # Both engines now hold the prefix: the less loaded of them takes the next one.
    loads = [2.0, 2.0]
    loads[holder] = 5.0
    assert router.choose([[*SHARED, 2]], loads) == 1 - holder


def test_dead_engines_are_skipped_and_forgotten() -> None:
    router = Router("cache_aware", BLOCK)
    holder = router.choose([SHARED], [0, 0])
    loads: list[float | None] = [0, 0]
    loads[holder] = None
    assert router.choose([SHARED], loads) == 1 - holder
    router.prefixes.forget(1 - holder)
    router.prefixes.forget(holder)
    assert not router.prefixes.holders
    with pytest.raises(LookupError):
        router.choose([SHARED], [None, None])


def test_round_robin_ignores_load_and_prefixes() -> None:
    router = Router("round_robin", BLOCK)
    assert [router.choose([SHARED], [9, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert router.choose([SHARED], [None, 0, 0]) in (1, 2)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing policy"):
        Router("random", BLOCK)


def test_the_blocks_an_engine_was_sent_are_counted_from_the_start() -> None:
    router = Router("cache_aware", BLOCK)
    hashes = prefix_hashes([*SHARED, 7, 7, 7, 7], BLOCK)  # five blocks
    router.prefixes.record(prefix_hashes(SHARED[:8], BLOCK), 1)
    assert router.prefixes.num_blocks_held(hashes, 1) == 2
    assert router.prefixes.num_blocks_held(hashes, 0) == 0
    router.prefixes.record(hashes, 0)
    assert router.prefixes.num_blocks_held(hashes, 0) == 5


class FakeClient:
    """What EnginePool reads of an EngineClient."""

    def __init__(self, rank: int) -> None:
        self.rank, self.engine_dead, self.restarts, self.ready = rank, False, 0, None
        self.num_in_flight = self.num_waiting_estimate = 0


def pool_with_roles(*roles: str) -> tuple[EnginePool, list[FakeClient]]:
    clients = [FakeClient(rank) for rank in range(len(roles))]
    return EnginePool(clients, Router("cache_aware", BLOCK), LoomMetrics(),  # type: ignore[arg-type]
                      list(roles)), clients


def test_roles_split_a_request_while_both_kinds_serve() -> None:
    pool, clients = pool_with_roles("prefill", "decode", "decode")
    first = pool.route([SHARED])
    assert isinstance(first, PrefillDecodeRoute) and first.prefill is clients[0]
    assert first.decode_holds == {tuple(SHARED): 0}
    again = pool.route([SHARED])  # the same decode engine, which was sent all four blocks
    assert isinstance(again, PrefillDecodeRoute) and again.decode is first.decode
    assert again.decode_holds == {tuple(SHARED): 4}
    clients[0].engine_dead = True  # no prefill engine: requests run whole
    assert pool.route([SHARED]) in clients[1:]
    clients[0].engine_dead, clients[1].engine_dead, clients[2].engine_dead = False, True, True
    assert pool.route([SHARED]) is clients[0]


def test_without_roles_or_with_one_engine_for_both_nothing_splits() -> None:
    pool, clients = pool_with_roles("both")
    assert pool.route([SHARED]) is clients[0]
    plain = EnginePool([FakeClient(0), FakeClient(1)], Router("load", BLOCK),  # type: ignore[list-item]
                       LoomMetrics())
    assert not isinstance(plain.route([SHARED]), PrefillDecodeRoute)
