"""The KV cache on 2 MiB pages (Linux, CPU), mapped fresh from the kernel.

Decode attention reads each request's blocks, scattered over the cache, a few KiB at a time.
On 4 KiB pages nearly every block costs a TLB miss and a page walk before its first line
arrives; on 2 MiB pages one TLB entry covers hundreds of blocks (docs/benchmarks.md, "Issue
27, first pass"). Linux gives anonymous memory huge pages only where asked
(`transparent_hugepage` = madvise, the common default), so the cache is its own anonymous
mapping, advised before its pages are first touched. A fresh mapping reads as zeros without
being written: a large cache takes memory as blocks are used. A page's first touch is dear,
though (on the 2-vCPU VM of docs/benchmarks.md, ~2 ms per 2 MiB page: a decode step that
opened new blocks in every layer's cache paid ~15 ms, and far more where every layer's cache
crossed into a fresh huge page at once: `skews`), so `PagesAhead` maps the blocks the
pool hands out first at start, and then a stretch ahead of the blocks steps write: in a thread
where the kernel can do it without writing (`MADV_POPULATE_WRITE`, Linux 5.14), so the engine
does not wait ~0.6 s for 512 MiB of a fresh VM's pages before it serves, nor ~10 ms a page
mid-step once its cache outgrows them. Elsewhere the cache is an ordinary zeroed tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
PAGE_BYTES = 4096
MADV_POPULATE_WRITE = 23
LOWEST_PRIORITY = 19  # nice


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        skew: float = 0.0) -> torch.Tensor:
    """torch.zeros(shape), on 2 MiB pages where the platform gives them, starting `skew` (0 to
    1) of a huge page past a page boundary (cache-line aligned). Caches given different skews
    open their fresh pages at different block ids, one at a time (`skews`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # Two huge pages more than needed: one to start on a 2 MiB boundary, one for the skew.
    mapping = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES + int(skew * HUGE_PAGE_BYTES) // 64 * 64
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def skews(count: int) -> list[float]:
    """Evenly spread skews for `count` caches indexed by the same block ids. With one skew for
    all, the block id that crosses into a fresh 2 MiB page does so in every cache at once: a
    step that opened the default model's 60 fresh pages together took ~320 ms instead of ~45
    on a 2-vCPU VM, every ~8 s under load until the whole cache had been used once. Spread,
    such a step opens one or two."""
    return [index / count for index in range(count)]


def populate(tensor: torch.Tensor, end: int, start: int = 0) -> None:
    """Touches bytes [start, end) of a CPU tensor's pages (their values are kept)."""
    if tensor.device.type != "cpu" or end <= start:
        return
    flat = tensor.view(-1).view(torch.uint8)[start:end]
    flat[::PAGE_BYTES].add_(0)  # one write per page: the kernel maps (and zeroes) each once


def prefault(tensors: list[torch.Tensor], end: int, start: int = 0) -> threading.Thread | None:
    """Maps bytes [start, end) of each CPU tensor's pages, their values kept. Where the kernel
    populates pages on request (nothing written: the engine may use them meanwhile), a thread
    does it, returned; else they are touched here (`populate`) and None returned."""
    tensors = [tensor for tensor in tensors if tensor.device.type == "cpu"]
    if not tensors or end <= start:
        return None
    if not populates_in_background(tensors[0]):
        for tensor in tensors:
            populate(tensor, end, start)
        return None
    thread = threading.Thread(target=populate_all, args=(tensors, end, start),
                              name="kv-prefault", daemon=True)
    thread.start()
    return thread


def populates_in_background(tensor: torch.Tensor) -> bool:
    """Whether the kernel maps pages on request (asked on the tensor's first page)."""
    return tensor.device.type == "cpu" and populate_write(tensor, PAGE_BYTES)


def populate_all(tensors: list[torch.Tensor], end: int, start: int = 0) -> None:
    """In the thread: at the lowest priority, so that the engine's compute threads keep their
    cores (sharing them, an OpenMP step waits on its slowest thread: steps of a 2,000-token
    prompt took up to 2.4x their time on a 2-core VM while pages were mapped beside them)."""
    with contextlib.suppress(AttributeError, OSError):  # none here: mapped all the same
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    for tensor in tensors:
        if not populate_write(tensor, end, start):
            logger.warning("could not map the KV cache's pages ahead of use")
            return


def populate_write(tensor: torch.Tensor, end: int, start: int = 0) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the pages holding a tensor's bytes [start, end)
    (through ctypes, which lets go of the GIL for the call); False where the platform refuses
    it."""
    madvise = libc_madvise()
    if madvise is None:
        return False
    base = tensor.data_ptr()
    first = base + start
    last = base + min(end, tensor.numel() * tensor.element_size())
    if last <= first:
        return True
    first_page = first - first % PAGE_BYTES
    return madvise(first_page, last - first_page, MADV_POPULATE_WRITE) == 0


@dataclass
class PagesAhead:
    """Maps the KV cache's pages a stretch of blocks ahead of the highest block a step writes,
    in a thread. The pool hands out low block ids first, so the blocks steps open next lie just
    past the highest written so far; mapped before, their pages' first touch (milliseconds
    each) is not paid inside a step. At most one stretch is mapped beyond what steps reach, so
    a large cache still takes memory as it is used. Where the kernel cannot map pages in the
    background (Linux before 5.14) only the first stretch is mapped, at start."""

    caches: list[torch.Tensor]  # each indexed by block id on its first dimension
    num_blocks: int
    stretch: int  # blocks mapped at a time
    mapped: int = 0  # blocks [0, mapped) of every cache are mapped or being mapped
    thread: threading.Thread | None = None
    background: bool = False

    def __post_init__(self) -> None:
        self.caches = [cache for cache in self.caches if cache.device.type == "cpu"]
        self.background = bool(self.caches) and populates_in_background(self.caches[0])
        self._map_next()

    @property
    def block_bytes(self) -> int:
        return self.caches[0][0].numel() * self.caches[0].element_size()

    def follow(self, highest_block: int) -> None:
        """A step writes blocks up to `highest_block`: within half a stretch of what is mapped,
        the next stretch is mapped (once the one before has been)."""
        if not self.background or self.mapped >= self.num_blocks \
                or highest_block < self.mapped - self.stretch // 2:
            return
        if self.thread is None or not self.thread.is_alive():
            self._map_next()

    def map_all(self) -> None:
        """Maps every page now, here (as a cache that steps have used whole is mapped)."""
        if self.thread is not None:
            self.thread.join()
        for cache in self.caches:
            populate(cache, cache.numel() * cache.element_size())
        self.mapped = self.num_blocks

    def _map_next(self) -> None:
        if not self.caches or self.stretch <= 0:
            return
        start, self.mapped = self.mapped, min(self.num_blocks, self.mapped + self.stretch)
        self.thread = prefault(self.caches, self.mapped * self.block_bytes,
                               start * self.block_bytes)


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
