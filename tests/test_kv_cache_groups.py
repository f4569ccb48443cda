"""KV cache groups: how layers split into groups, and a sliding-window group's table giving
the blocks behind its window back to the pool (pure Python, no model)."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from engine.block_manager import BlockManager
from engine.kv_cache_groups import KVCacheGroup, KVCacheLayout, blocks_for
from engine.scheduler import Scheduler
from tests.scheduler_helpers import EOS, make_request, run_step, run_until_idle

BS = 4
GEMMA3_270M = [None if (layer + 1) % 6 == 0 else 512 for layer in range(18)]


def test_layers_of_one_kind_form_one_group() -> None:
    assert KVCacheLayout.for_windows([None] * 4).groups == (KVCacheGroup((0, 1, 2, 3), None),)
    assert KVCacheLayout.for_windows([16] * 3).groups == (KVCacheGroup((0, 1, 2), 16),)


def test_mixed_layers_split_into_equal_groups_of_one_kind() -> None:
    layout = KVCacheLayout.for_windows(GEMMA3_270M)
    assert layout.group_size == 3
    assert layout.windows == (512,) * 5 + (None,)
    assert layout.groups[-1].layers == (5, 11, 17)
    assert layout.place(17) == (5, 2)
    assert layout.place(6) == (1, 2)  # sliding layers (0, 1, 2), (3, 4, 6), ... in threes
    assert sorted(layer for group in layout.groups for layer in group.layers) == list(range(18))
    assert layout.describe() == "5 sliding(512) + 1 full groups of 3 layers"
    # Gemma 2 alternates: half and half.
    alternating = KVCacheLayout.for_windows([4096, None] * 13)
    assert alternating.windows == (4096, None) and alternating.group_size == 13


def test_without_hybrid_a_mixed_model_is_one_global_group() -> None:
    layout = KVCacheLayout.for_windows(GEMMA3_270M, hybrid=False)
    assert layout.windows == (None,) and layout.group_size == 18


def test_the_first_live_block_trails_the_window() -> None:
    group = KVCacheGroup((0,), window=8)
    # The query at position p sees keys p - 7 .. p.
    assert [group.first_live_block(n, BS) for n in (0, 7, 8, 11, 12, 100)] == [0, 0, 0, 1, 1, 23]
    assert KVCacheGroup((0,), None).first_live_block(100, BS) == 0
    # At most the window (one block more when unaligned) plus the chunk's blocks at once.
    assert group.max_live_blocks(1000, 16, BS) == blocks_for(7, BS) + 1 + 4
    assert group.max_live_blocks(6, 16, BS) == 2


def decode(manager: BlockManager, request, steps: int) -> None:
    """What the scheduler does per decode step: one more slot, computed, committed."""
    for _ in range(steps):
        manager.allocate(request, request.num_computed_tokens + 1)
        request.num_computed_tokens += 1
        request.token_ids.append(7)
        manager.commit(request)


def test_a_sliding_group_returns_the_blocks_behind_its_window() -> None:
    manager = BlockManager(64, BS, groups=(KVCacheGroup((0,), 8), KVCacheGroup((1,), None)))
    request = make_request("long", prompt_len=1)
    decode(manager, request, 60)
    sliding, full = request.block_tables
    assert len(full) == len(sliding) == 15
    live = [block for block in sliding if block != manager.null_block]
    assert len(live) == 2  # the next query (at 60) sees keys 53..60: blocks 13, 14 (and 15)
    assert sliding[:13] == [manager.null_block] * 13
    assert manager.num_free_blocks == 64 - 15 - 2
    assert manager.check_integrity([request]) == []
    manager.free(request)
    assert manager.num_free_blocks == 64 and manager.check_integrity([]) == []


def test_a_prefix_hit_takes_only_the_window_of_a_sliding_group() -> None:
    groups = (KVCacheGroup((0,), 8), KVCacheGroup((1,), None))
    manager = BlockManager(64, BS, groups=groups)
    first = make_request("first", prompt=list(range(1, 34)))  # 8 full blocks + 1 token
    manager.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    manager.commit(first)
    manager.free(first)
    again = make_request("again", prompt=list(range(1, 34)))
    prefix = manager.cached_prefix(again)
    assert prefix.num_blocks == 8
    sliding, full = prefix.tables
    assert full == first_table(manager, 1, 8)
    # Queries from position 32 see keys 25 on: blocks 6 and 7 of the sliding layer.
    assert sliding[:6] == [manager.null_block] * 6 and sliding[6:] == first_table(manager, 0, 8)[6:]
    manager.take_prefix(again, prefix)
    manager.allocate(again, again.num_tokens)
    assert manager.check_integrity([again]) == []


def first_table(manager: BlockManager, group: int, count: int) -> list[int]:
    """The cached blocks of group `group` for the first `count` blocks of range(1, 34)."""
    probe = make_request("probe", prompt=list(range(1, 34)))
    hashes = manager.block_hashes(probe)[:count]
    return [manager.cached[group][h] for h in hashes]


def test_a_hit_stops_where_a_sliding_group_lost_its_window() -> None:
    groups = (KVCacheGroup((0,), 8), KVCacheGroup((1,), None))
    manager = BlockManager(64, BS, groups=groups)
    first = make_request("first", prompt=list(range(1, 34)))
    manager.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    manager.commit(first)
    manager.free(first)
    hashes = manager.block_hashes(first)
    del manager.cached[0][hashes[7]]  # block 7 of the sliding layer: as if evicted
    prefix = manager.cached_prefix(make_request("again", prompt=list(range(1, 34))))
    # A hit of 7 blocks needs sliding blocks 5 and 6 (keys 21.. for the query at 28).
    assert prefix.num_blocks == 7


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_long_request_holds_only_its_window_in_sliding_groups(hybrid: bool) -> None:
    config = EngineConfig(model="unused", block_size=BS, max_num_batched_tokens=16)
    layout = KVCacheLayout.for_windows([8, 8, None], hybrid=hybrid)
    manager = BlockManager(200, BS, groups=layout.groups)
    scheduler = Scheduler(config, manager, 1024, [EOS])
    request = make_request("long", prompt_len=100, max_tokens=200)
    others = [make_request(f"short{i}", prompt_len=9, max_tokens=30) for i in range(3)]
    for each in (request, *others):
        scheduler.add(each)
    most_held = 0
    while request.num_output_tokens < 150:
        run_step(scheduler)
        held = [sum(block != manager.null_block for block in table)
                for table in request.block_tables]
        most_held = max(most_held, held[0])
        assert held[-1] == blocks_for(request.num_computed_tokens, BS)  # the global group
    # Window 8 and chunks of at most 16 tokens: 2 + 1 + 4 blocks at most, against 63.
    assert most_held <= (7 if hybrid else blocks_for(250, BS))
    assert most_held >= (3 if hybrid else 60)
    run_until_idle(scheduler)
    assert manager.num_free_blocks == manager.num_blocks
