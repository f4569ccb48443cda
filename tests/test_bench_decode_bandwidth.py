"""bench.decode_bandwidth: the kernel and the streaming read timed in turns, on a small cache."""
from __future__ import annotations

import math

import pytest

from bench.decode_bandwidth import DTYPES, alternating_seconds, measure
from engine.kernels.paged_decode import load_cpp_decode


def test_the_kernel_and_the_stream_are_timed_in_turns() -> None:
    calls: list[str] = []
    kernel_s, stream_s = alternating_seconds(lambda: calls.append("kernel"),
                                             lambda: calls.append("stream"), repeats=3)
    assert calls == ["kernel", "stream"] * 4  # one untimed pair first, then three timed
    assert kernel_s >= 0 and stream_s >= 0


@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_a_small_cache_reports_finite_rates(cache: str) -> None:
    assert load_cpp_decode() is not None, "the C++ decode kernel did not build"
    ms, kernel_gbs, stream_gbs = measure(batch=2, context=40, dtypes=DTYPES[cache],
                                         block_size=16, layers=2, repeats=2, plain_pages=True)
    assert all(math.isfinite(x) and x > 0 for x in (ms, kernel_gbs, stream_gbs))
