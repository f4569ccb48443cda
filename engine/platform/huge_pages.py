"""The KV cache on 2 MiB pages (Linux, CPU).

Decode attention reads each request's blocks, scattered over the cache, a few KiB at a time.
On 4 KiB pages nearly every block costs a TLB miss and a page walk before its first line
arrives; on 2 MiB pages one TLB entry covers hundreds of blocks (docs/benchmarks.md, "Decode
attention on 2 MiB pages"). Linux gives anonymous memory huge pages only where asked
(`transparent_hugepage` = madvise, the common default), so the cache is allocated aligned to
2 MiB and advised before its pages are first touched. Elsewhere, or when the kernel says no,
it is an ordinary tensor.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on 2 MiB pages where the platform gives them."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise() if sys.platform.startswith("linux") else None
    if device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or madvise is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    advised = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise(raw.data_ptr() + offset, advised, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    # The view keeps `raw`'s storage alive; zeroing is the pages' first touch.
    return raw[offset:offset + nbytes].view(dtype).view(shape).zero_()
