"""The KV cache's allocation on 2 MiB pages (engine.platform.huge_pages)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.platform.huge_pages import HUGE_PAGE_BYTES, populate, zeros_on_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_kib(address: int, field: str) -> int:
    """A field (Rss, AnonHugePages) of the mapping holding `address`, from /proc/self/smaps."""
    mapping_start = mapping_end = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            mapping_start, mapping_end = start, end
        elif head == f"{field}:" and mapping_start <= address < mapping_end:
            return int(line.split()[1])
    return 0


def test_a_large_cache_is_zeroed_aligned_and_shaped() -> None:
    shape = (2000, 3, 16, 64)  # 12 MB
    cache = zeros_on_huge_pages(shape, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    cache.fill_(1)  # all of it is writable memory of its own
    assert cache.float().sum().item() == cache.numel()


def test_a_small_tensor_is_an_ordinary_one() -> None:
    small = zeros_on_huge_pages((4, 8), torch.float32, torch.device("cpu"))
    assert small.shape == (4, 8) and not small.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings")
def test_a_cache_takes_memory_only_as_it_is_used() -> None:
    cache = zeros_on_huge_pages((256 << 20,), torch.uint8, torch.device("cpu"))
    assert mapping_kib(cache.data_ptr(), "Rss") < 8 << 10  # not written: not resident
    cache[: 16 << 20].fill_(1)
    assert 16 << 10 <= mapping_kib(cache.data_ptr(), "Rss") < 64 << 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's transparent huge pages")
def test_the_kernel_backs_the_cache_with_huge_pages_where_it_gives_them() -> None:
    """(Whether an ordinary allocation gets huge pages too is the allocator's and the
    kernel's business: torch may ask for them for large tensors, khugepaged may collapse
    them later. Only the cache's own pages are checked.)"""
    setting = THP_SETTING.read_text() if THP_SETTING.exists() else "[never]"
    cache = zeros_on_huge_pages((64 << 20,), torch.uint8, torch.device("cpu"))
    cache.fill_(1)
    huge_kib = mapping_kib(cache.data_ptr(), "AnonHugePages")
    assert huge_kib == 0 if "[never]" in setting else huge_kib >= 32 << 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings")
def test_populate_touches_the_first_bytes_and_keeps_the_values() -> None:
    cache = zeros_on_huge_pages((64 << 20,), torch.uint8, torch.device("cpu"))
    cache[5] = 7
    populate(cache, 8 << 20)
    resident = mapping_kib(cache.data_ptr(), "Rss")
    assert 8 << 10 <= resident < 16 << 10
    assert cache[5].item() == 7 and cache[:8 << 20].sum().item() == 7
