"""Block manager unit tests: allocation, prefix caching, ref counts, LRU eviction, integrity."""

from __future__ import annotations

from engine.block_manager import ROOT_HASH, BlockManager, blocks_for, hash_block
from tests.scheduler_helpers import make_request, make_scheduler, run_step, run_until_idle

BS = 4


def shared(request_id: str, tokens: list[int], max_tokens: int = 4):
    return make_request(request_id, prompt=list(tokens), max_tokens=max_tokens)


def admit(manager: BlockManager, request, extra_tokens: int = 0) -> int:
    """What the scheduler does at admission; returns the cached tokens found."""
    prefix = manager.cached_prefix(request)
    assert manager.can_allocate(request, request.num_tokens + extra_tokens, prefix)
    manager.take_prefix(request, prefix)
    manager.allocate(request, request.num_tokens + extra_tokens)
    return prefix.num_blocks * manager.block_size


def compute_all(manager: BlockManager, request) -> None:
    request.num_computed_tokens = request.num_tokens
    manager.commit(request)


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_extends_the_block_table_only_as_needed():
    manager = BlockManager(num_blocks=8, block_size=BS)
    request = make_request("r", prompt_len=5)
    manager.allocate(request, 5)
    assert len(request.block_tables[0]) == 2
    manager.allocate(request, 8)
    assert len(request.block_tables[0]) == 2
    manager.allocate(request, 9)
    assert len(request.block_tables[0]) == 3
    assert manager.num_free_blocks == 5
    assert abs(manager.usage - 3 / 8) < 1e-9


def test_hash_chains_through_the_parent():
    tokens = (1, 2, 3, 4)
    first = hash_block(ROOT_HASH, tokens)
    assert hash_block(ROOT_HASH, tokens) == first
    assert hash_block(first, tokens) != first  # same tokens, other parent: another block
    assert hash_block(ROOT_HASH, (1, 2, 3, 5)) != first
    manager = BlockManager(num_blocks=8, block_size=BS)
    request = shared("r", [1, 2, 3, 4, 1, 2, 3, 4, 9])
    hashes = manager.block_hashes(request)
    assert hashes == [first, hash_block(first, tokens)]  # the partial third block has none


def test_a_new_request_reuses_the_longest_cached_prefix():
    manager = BlockManager(num_blocks=16, block_size=BS)
    first = shared("first", range(1, 13))  # three full blocks
    admit(manager, first)
    compute_all(manager, first)
    partial_match = shared("second", [*range(1, 9), 99, 98, 97, 96, 95])
    assert admit(manager, partial_match) == 8
    assert partial_match.block_tables[0][:2] == first.block_tables[0][:2]
    assert partial_match.block_tables[0][2] != first.block_tables[0][2]
    assert manager.stats.hits == 8 and manager.stats.queries == 12 + 13


def test_the_last_token_is_always_computed():
    manager = BlockManager(num_blocks=16, block_size=BS)
    first = shared("first", range(1, 9))
    admit(manager, first)
    compute_all(manager, first)
    identical = shared("identical", range(1, 9))  # block aligned, fully cached
    assert admit(manager, identical) == 4  # the second block is recomputed for its last token
    assert identical.num_computed_tokens == 4


def test_a_partial_last_block_is_never_shared():
    manager = BlockManager(num_blocks=16, block_size=BS)
    first = shared("first", range(1, 7))  # one full block and a partial one
    admit(manager, first)
    compute_all(manager, first)
    assert len(manager.cached[0]) == 1
    longer = shared("longer", range(1, 12))
    assert admit(manager, longer) == 4
    assert longer.block_tables[0][1] != first.block_tables[0][1]


def test_reference_counts_under_shared_use():
    manager = BlockManager(num_blocks=16, block_size=BS)
    owners = [shared(f"r{i}", [*range(1, 9), 50 + i]) for i in range(3)]
    admit(manager, owners[0])
    compute_all(manager, owners[0])
    for owner in owners[1:]:
        admit(manager, owner)
    shared_blocks = owners[0].block_tables[0][:2]
    assert [manager.blocks[b].ref_count for b in shared_blocks] == [3, 3]
    manager.free(owners[0])
    assert [manager.blocks[b].ref_count for b in shared_blocks] == [2, 2]
    assert not any(b in manager.free_queue for b in shared_blocks)
    for owner in owners[1:]:
        manager.free(owner)
    assert all(manager.blocks[b].ref_count == 0 and b in manager.free_queue
               for b in shared_blocks)
    assert manager.check_integrity([]) == []


def test_freed_blocks_stay_cached_and_are_evicted_in_lru_order_tail_first():
    manager = BlockManager(num_blocks=6, block_size=BS)
    older = shared("older", range(1, 10))  # 2 full blocks + 1 partial
    newer = shared("newer", range(100, 109))
    for request in (older, newer):
        admit(manager, request)
        compute_all(manager, request)
    o0, o1, o2 = older.block_tables[0]
    n0, n1, n2 = newer.block_tables[0]
    manager.free(older)
    manager.free(newer)
    # Unhashed partial blocks go to the front; chains join the back tail first, in LRU order.
    assert list(manager.free_queue) == [n2, o2, o1, o0, n1, n0]
    assert len(manager.cached[0]) == 4
    # Four fresh blocks: the two partials, then older's tail, then older's head.
    admit(manager, shared("taker", range(500, 516)))
    assert sorted(manager.cached[0].values()) == sorted([n0, n1])
    assert manager.cached_prefix(shared("newer-again", range(100, 109))).tables == [[n0, n1]]
    assert manager.cached_prefix(shared("older-again", range(1, 10))).num_blocks == 0


def test_eviction_under_pressure_never_touches_a_block_in_use():
    manager = BlockManager(num_blocks=6, block_size=BS)
    user = shared("user", range(1, 9))
    admit(manager, user)
    compute_all(manager, user)
    in_use = set(user.block_tables[0])
    hog = shared("hog", range(200, 216))
    assert admit(manager, hog) == 0
    assert not in_use & set(hog.block_tables[0])
    assert not manager.can_allocate(shared("more", range(300, 304)), 4)
    assert manager.check_integrity([user, hog]) == []


def test_a_preempted_request_finds_its_prefix_again():
    scheduler = make_scheduler(num_blocks=6, block_size=BS, max_model_len=64)
    for request_id in "abc":
        scheduler.add(make_request(request_id, prompt_len=8, max_tokens=8))
    run_step(scheduler)
    trace = run_step(scheduler).trace
    assert trace.preempted == ["c"]
    hits_before = scheduler.block_manager.stats.hits
    run_until_idle(scheduler)
    assert scheduler.block_manager.stats.hits >= hits_before + 4


def test_prefix_caching_off_shares_nothing():
    manager = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    first = shared("first", range(1, 13))
    admit(manager, first)
    compute_all(manager, first)
    assert admit(manager, shared("second", range(1, 13))) == 0
    assert manager.cached == [{}]


def test_integrity_check_finds_leaks_double_ownership_and_bad_hashes():
    manager = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_request("a", prompt_len=4), make_request("b", prompt_len=4)
    manager.allocate(a, 4)
    manager.allocate(b, 4)
    assert manager.check_integrity([a, b]) == []
    assert any("1 live owners" not in p and "0 live owners" in p
               for p in manager.check_integrity([a]))  # b's block is held by nobody alive
    a.num_computed_tokens = 4
    manager.commit(a)
    assert manager.check_integrity([a, b]) == []
    manager.blocks[a.block_tables[0][0]].token_ids = (9, 9, 9, 9)
    assert any("does not match" in p for p in manager.check_integrity([a, b]))
    assert manager.num_integrity_violations >= 2
