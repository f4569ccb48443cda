"""Block manager unit tests: O(1) allocate/free, block tables, integrity check."""

from __future__ import annotations

from engine.block_manager import BlockManager, blocks_for
from tests.scheduler_helpers import make_request


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_extends_the_block_table_only_as_needed():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request("r", prompt_len=5)
    manager.allocate(request, 5)
    assert len(request.block_table) == 2
    manager.allocate(request, 8)
    assert len(request.block_table) == 2
    manager.allocate(request, 9)
    assert len(request.block_table) == 3
    assert manager.num_free_blocks == 5
    assert abs(manager.usage - 3 / 8) < 1e-9


def test_can_allocate_and_free():
    manager = BlockManager(num_blocks=3, block_size=4)
    a, b = make_request("a", prompt_len=8), make_request("b", prompt_len=8)
    manager.allocate(a, 8)
    assert not manager.can_allocate(b, 8)
    assert manager.can_allocate(b, 4)
    manager.free(a)
    assert a.block_table == [] and manager.num_free_blocks == 3
    assert manager.can_allocate(b, 8)


def test_free_returns_blocks_tail_first():
    manager = BlockManager(num_blocks=4, block_size=1)
    request = make_request("r", prompt_len=2)
    manager.allocate(request, 2)
    table = list(request.block_table)
    manager.free(request)
    assert list(manager.free_block_ids)[-2:] == table[::-1]


def test_integrity_check_finds_leaks_and_double_ownership():
    manager = BlockManager(num_blocks=4, block_size=4)
    a, b = make_request("a", prompt_len=4), make_request("b", prompt_len=4)
    manager.allocate(a, 4)
    manager.allocate(b, 4)
    assert manager.check_integrity([a, b]) == []
    problems = manager.check_integrity([a])  # b's block is held by nobody alive
    assert any("neither free nor owned" in p for p in problems)
    b.block_table = list(a.block_table)
    problems = manager.check_integrity([a, b])
    assert any("also held by" in p for p in problems)
    assert manager.num_integrity_violations >= 2
