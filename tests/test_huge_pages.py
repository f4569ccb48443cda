"""The KV cache's allocation on 2 MiB pages (engine.platform.huge_pages)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.executor.model_runner import ModelRunner, StepInputs
from engine.platform import huge_pages
from engine.platform.huge_pages import (
    HUGE_PAGE_BYTES,
    PagesAhead,
    populate,
    prefault,
    skews,
    zeros_on_huge_pages,
)
from engine.weights.loader import load_model
from tests.model_fixtures import build_tiny_llama_dir

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_kib(address: int, field: str) -> int:
    """A field (Rss, AnonHugePages) of the mapping holding `address`, from /proc/self/smaps."""
    return sum(mappings_kib([address], field).values())


def mappings_kib(addresses: list[int], field: str) -> dict[int, int]:
    """The field of each mapping holding one of `addresses` (adjacent anonymous mappings
    merge into one), by the mapping's start."""
    found: dict[int, int] = {}
    mapping_start = mapping_end = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            mapping_start, mapping_end = (int(part, 16) for part in head.split("-"))
        elif head == f"{field}:" and any(mapping_start <= address < mapping_end
                                         for address in addresses):
            found[mapping_start] = int(line.split()[1])
    return found


def test_a_large_cache_is_zeroed_aligned_and_shaped() -> None:
    shape = (2000, 3, 16, 64)  # 12 MB
    cache = zeros_on_huge_pages(shape, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    cache.fill_(1)  # all of it is writable memory of its own
    assert cache.float().sum().item() == cache.numel()


def most_fresh_pages_opened_by_one_block(caches: list[torch.Tensor]) -> int:
    """Over block ids (dim 0), the most caches whose block starts a huge page or crosses
    into one: the pages a step that first writes that block maps together."""
    most = 0
    for block in range(caches[0].shape[0]):
        opened = 0
        for cache in caches:
            start = cache[block].data_ptr()
            end = start + cache[block].numel() * cache.element_size()
            opened += start % HUGE_PAGE_BYTES == 0 or start // HUGE_PAGE_BYTES != (
                end - 1) // HUGE_PAGE_BYTES
        most = max(most, opened)
    return most


def test_skewed_caches_open_their_fresh_pages_at_different_blocks() -> None:
    shape = (1200, 3, 16, 64)  # 6 KiB blocks in bf16, 341 to a huge page
    cpu = torch.device("cpu")
    aligned = [zeros_on_huge_pages(shape, torch.bfloat16, cpu) for _ in range(12)]
    assert most_fresh_pages_opened_by_one_block(aligned) == 12
    skewed = [zeros_on_huge_pages(shape, torch.bfloat16, cpu, skew) for skew in skews(12)]
    assert most_fresh_pages_opened_by_one_block(skewed) == 1
    for cache, skew in zip(skewed, skews(12), strict=True):
        assert cache.data_ptr() % 64 == 0 and not cache.any()
        assert cache.data_ptr() % HUGE_PAGE_BYTES == int(skew * HUGE_PAGE_BYTES) // 64 * 64
        cache.fill_(1)  # all of it is writable memory of its own
        assert cache.float().sum().item() == cache.numel()


def test_the_runners_caches_are_skewed(tmp_path: Path) -> None:
    model = load_model(build_tiny_llama_dir(tmp_path), torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, 4096, 16, torch.device("cpu"), torch.float32)
    caches = [cache for pair in runner.kv_caches for cache in pair]
    assert caches[0].numel() * caches[0].element_size() > HUGE_PAGE_BYTES  # on huge pages
    assert most_fresh_pages_opened_by_one_block(caches) == 1


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings")
def test_prefault_maps_the_first_bytes_of_each_cache_in_a_thread_and_keeps_the_values(
        ) -> None:
    caches = [zeros_on_huge_pages((64 << 20,), torch.uint8, torch.device("cpu"))
              for _ in range(2)]
    caches[1][5] = 7
    thread = prefault(caches, 8 << 20)
    assert thread is not None  # Linux 5.14 and later: this machine's kernels
    caches[0][3] = 9  # the engine may write meanwhile: nothing of the prefault writes
    thread.join(timeout=60)
    resident = sum(mappings_kib([cache.data_ptr() for cache in caches], "Rss").values())
    assert 16 << 10 <= resident < 24 << 10
    assert caches[0][3].item() == 9 and caches[1][5].item() == 7
    assert caches[0].sum().item() == 9 and caches[1].sum().item() == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings")
def test_without_the_kernels_help_prefault_touches_the_pages_before_returning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "libc_madvise", lambda: None)
    cache = zeros_on_huge_pages((64 << 20,), torch.uint8, torch.device("cpu"))
    cache[5] = 7
    assert prefault([cache], 8 << 20) is None
    assert 8 << 10 <= mapping_kib(cache.data_ptr(), "Rss") < 16 << 10
    assert cache.sum().item() == 7


def resident_mib(caches: list[torch.Tensor]) -> int:
    """The caches' resident MiB together (adjacent mappings merge: counted once)."""
    return round(sum(mappings_kib([cache.data_ptr() for cache in caches], "Rss").values()) / 1024)


def wait(pages: PagesAhead) -> None:
    if pages.thread is not None:
        pages.thread.join(timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings")
def test_pages_ahead_maps_a_stretch_beyond_the_blocks_steps_write_and_no_further() -> None:
    """64 blocks of 1 MiB, stretches of 8: mapped at start, then the next stretch once a step
    writes within half a stretch of the mapped end, never past the cache, values kept."""
    caches = [zeros_on_huge_pages((64, 1 << 20), torch.uint8, torch.device("cpu"))
              for _ in range(2)]
    caches[1][12, 5] = 7  # a block the next stretch maps: it keeps its value
    pages = PagesAhead(caches, 64, stretch=8)
    assert pages.background  # Linux 5.14 and later: this machine's kernels
    wait(pages)
    assert pages.mapped == 8
    assert resident_mib(caches) == 8 + 10  # block 12's 2 MiB page too: written

    pages.follow(3)  # 3 < 8 - 4: far enough from the mapped end
    assert pages.mapped == 8 and pages.thread is not None and not pages.thread.is_alive()
    pages.follow(4)
    wait(pages)
    assert pages.mapped == 16
    assert resident_mib(caches) == 16 + 16
    for _ in range(20):
        pages.follow(10_000)
        wait(pages)
    assert pages.mapped == 64
    assert resident_mib(caches) == 64 + 64
    assert caches[1][12, 5].item() == 7 and caches[1].sum().item() == 7
    assert caches[0].sum().item() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings")
def test_without_the_kernels_help_pages_ahead_maps_only_the_first_stretch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Touching pages ahead in-step would cost what it saves: only the start's stretch."""
    monkeypatch.setattr(huge_pages, "libc_madvise", lambda: None)
    cache = zeros_on_huge_pages((64, 1 << 20), torch.uint8, torch.device("cpu"))
    pages = PagesAhead([cache], 64, stretch=8)
    assert not pages.background and pages.thread is None
    assert resident_mib([cache]) == 8
    pages.follow(60)
    assert pages.mapped == 8 and resident_mib([cache]) == 8


def test_the_runner_maps_pages_ahead_of_the_blocks_its_steps_write(tmp_path: Path) -> None:
    model = load_model(build_tiny_llama_dir(tmp_path), torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, 4096, 16, torch.device("cpu"), torch.float32)
    followed: list[int] = []
    runner.pages.follow = followed.append  # type: ignore[method-assign]
    inputs = StepInputs(token_ids=[1, 2, 3], positions=[0, 1, 0], slot_mappings=[[32, 33, 80]],
                        query_lens=[2, 1], seq_lens=[2, 1], block_tables=[[[2], [5]]],
                        sample_rows=[1, 2])
    runner.run(inputs)
    assert followed == [5]  # slot 80: block 5 of 16-token blocks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings")
def test_map_all_maps_every_page_at_once_and_keeps_the_values() -> None:
    caches = [zeros_on_huge_pages((64, 1 << 20), torch.uint8, torch.device("cpu"))
              for _ in range(2)]
    caches[0][40, 3] = 5
    pages = PagesAhead(caches, 64, stretch=8)
    pages.map_all()
    assert pages.mapped == 64 and resident_mib(caches) == 64 + 64
    assert caches[0].sum().item() == 5 and caches[1].sum().item() == 0
    pages.follow(63)  # nothing left to map: no thread starts
    assert pages.thread is None or not pages.thread.is_alive()
