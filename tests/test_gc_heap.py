"""A serving process's startup heap leaves the collector's full passes (common.gc_heap)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from common.gc_heap import freeze_startup_heap


@pytest.fixture
def unfrozen_afterwards() -> Iterator[None]:
    yield
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.links: list[Node] = [self]  # a cycle: only the collector frees it


def full_collection_s() -> float:
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def test_a_full_collection_no_longer_walks_the_startup_heap(unfrozen_afterwards) -> None:
    startup_heap = [Node() for _ in range(200_000)]
    before = full_collection_s()
    frozen = freeze_startup_heap()
    # (not equal: frozen objects that other threads of the suite drop leave the count)
    assert frozen >= len(startup_heap) and gc.get_freeze_count() >= len(startup_heap)
    assert full_collection_s() < before / 4


def test_garbage_made_after_the_freeze_is_still_collected(unfrozen_afterwards) -> None:
    freeze_startup_heap()
    Node()  # unreachable at once, kept alive only by its own cycle
    assert gc.collect() >= 1
