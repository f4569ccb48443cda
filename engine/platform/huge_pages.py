"""The KV cache on 2 MiB pages (Linux, CPU), mapped fresh from the kernel.

Decode attention reads each request's blocks, scattered over the cache, a few KiB at a time.
On 4 KiB pages nearly every block costs a TLB miss and a page walk before its first line
arrives; on 2 MiB pages one TLB entry covers hundreds of blocks (docs/benchmarks.md, "Issue
27, first pass"). Linux gives anonymous memory huge pages only where asked
(`transparent_hugepage` = madvise, the common default), so the cache is its own anonymous
mapping, advised before its pages are first touched. A fresh mapping reads as zeros without
being written: a large cache takes memory as blocks are used. A page's first touch is dear,
though (on the 2-vCPU VM of docs/benchmarks.md, ~2 ms per 2 MiB page: a decode step that
opened new blocks in every layer's cache paid ~15 ms), so `populate` touches the blocks the
pool hands out first at start. Elsewhere the cache is an ordinary zeroed tensor.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
PAGE_BYTES = 4096


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on 2 MiB pages where the platform gives them."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # One huge page more than needed, so that the tensor can start on a 2 MiB boundary.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def populate(tensor: torch.Tensor, nbytes: int) -> None:
    """Touches the first `nbytes` of a CPU tensor's pages (their values are kept)."""
    if tensor.device.type != "cpu" or nbytes <= 0:
        return
    flat = tensor.view(-1).view(torch.uint8)[:nbytes]
    flat[::PAGE_BYTES].add_(0)  # one write per page: the kernel maps (and zeroes) each once
