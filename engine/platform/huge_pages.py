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
crossed into a fresh huge page at once: `skews`), so `prefault` maps the blocks the
pool hands out first at start: in a thread where the kernel can do it without writing
(`MADV_POPULATE_WRITE`, Linux 5.14), so the engine does not wait ~0.6 s for 512 MiB of a
fresh VM's pages before it serves. Elsewhere the cache is an ordinary zeroed tensor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import sys
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
PAGE_BYTES = 4096
MADV_POPULATE_WRITE = 23


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


def populate(tensor: torch.Tensor, nbytes: int) -> None:
    """Touches the first `nbytes` of a CPU tensor's pages (their values are kept)."""
    if tensor.device.type != "cpu" or nbytes <= 0:
        return
    flat = tensor.view(-1).view(torch.uint8)[:nbytes]
    flat[::PAGE_BYTES].add_(0)  # one write per page: the kernel maps (and zeroes) each once


def prefault(tensors: list[torch.Tensor], nbytes: int) -> threading.Thread | None:
    """Maps the first `nbytes` of each CPU tensor's pages, their values kept. Where the kernel
    populates pages on request (nothing written: the engine may use them meanwhile), a thread
    does it, returned; else they are touched here (`populate`) and None returned."""
    tensors = [tensor for tensor in tensors if tensor.device.type == "cpu"]
    if not tensors or nbytes <= 0:
        return None
    if not populate_write(tensors[0], PAGE_BYTES):  # the kernel's answer, on one page
        for tensor in tensors:
            populate(tensor, nbytes)
        return None
    thread = threading.Thread(target=populate_all, args=(tensors, nbytes), name="kv-prefault",
                              daemon=True)
    thread.start()
    return thread


def populate_all(tensors: list[torch.Tensor], nbytes: int) -> None:
    for tensor in tensors:
        if not populate_write(tensor, nbytes):
            logger.warning("could not map the KV cache's first pages ahead of use")
            return


def populate_write(tensor: torch.Tensor, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the pages holding a tensor's first `nbytes` (through
    ctypes, which lets go of the GIL for the call); False where the platform refuses it."""
    madvise = libc_madvise()
    if madvise is None:
        return False
    start = tensor.data_ptr()
    end = start + min(nbytes, tensor.numel() * tensor.element_size())
    first_page = start - start % PAGE_BYTES
    return madvise(first_page, end - first_page, MADV_POPULATE_WRITE) == 0


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
