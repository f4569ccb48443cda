"""The Triton kernels (engine.attention.triton_kernels) through Triton's interpreter on the CPU,
against the torch reference: the KV write through the slot mapping, and paged attention over
decodes, prefills (fresh and on cached tokens) and mixed steps, at block boundaries, for GQA
ratios 1, 3 and 4 and head dims 64 and 128.

Triton is an optional dependency (`.[gpu]`, and in `.[dev]` for these tests): a CPU-only
install without it skips this module, CI installs it. tests/conftest.py sets
TRITON_INTERPRET=1 before anything can import triton (which reads it at import).

With LOOM_TRITON_NATIVE=1 (bench/gpu_check.sh on a GPU) the same tests compile the kernels
for CUDA and run them on the GPU instead.
"""

from __future__ import annotations

import os

import pytest
import torch

NATIVE = os.environ.get("LOOM_TRITON_NATIVE") == "1"
DEVICE = torch.device("cuda" if NATIVE else "cpu")
pytest.importorskip("triton", reason="triton is an optional dependency (pip install .[gpu])")

from engine.attention import triton_kernels as triton_attention  # noqa: E402
from engine.attention.reference import reference_attention, write_kv  # noqa: E402
from engine.attention.triton_backend import TritonBackend, query_rows, triton_supports  # noqa: E402
from tests.test_attention import Case, build, expected, make_inputs  # noqa: E402


def test_the_kernels_run_where_this_module_says() -> None:
    """Interpreted on the CPU unless LOOM_TRITON_NATIVE=1 (conftest.py sets the variable)."""
    assert os.environ["TRITON_INTERPRET"] == ("0" if NATIVE else "1")


BOUNDARY = ((1, 15), (1, 16), (1, 17), (1, 32), (1, 33))
TRITON_CASES = [
    Case("decode", ((1, 1), (1, 5), (1, 40), *BOUNDARY)),
    Case("prefill_fresh", ((12, 12), (16, 16))),
    Case("prefill_on_cache", ((5, 21), (16, 48))),
    Case("mixed", ((1, 16), (1, 33), (7, 7), (6, 20))),
    Case("mixed_block4", ((1, 3), (1, 8), (5, 13), (4, 4)), block_size=4),
    Case("gqa1_mha", ((1, 17), (6, 22)), num_heads=4, num_kv_heads=4),
    Case("gqa3", ((1, 17), (6, 22)), num_heads=6, num_kv_heads=2),
    Case("gqa4_dim128", ((1, 17), (1, 3), (6, 22)), num_heads=8, num_kv_heads=2, head_dim=128),
    Case("gqa3_dim128", ((1, 33), (5, 5)), num_heads=6, num_kv_heads=2, head_dim=128),
    # contexts of several tiles (TILE_TOKENS), ending on and just past a tile's edge
    Case("tiles", ((1, 64), (1, 65), (1, 130), (20, 150))),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda case: case.name)
def test_triton_kernels_match_the_reference(case: Case) -> None:
    inputs = make_inputs(case, torch.float32)
    metadata = build(inputs, TritonBackend(case.block_size, case.num_kv_heads))
    scale = case.head_dim**-0.5
    want, want_k_cache, want_v_cache = expected(inputs, metadata, scale)

    k_cache, v_cache = inputs.k_cache.to(DEVICE), inputs.v_cache.to(DEVICE)
    triton_attention.write_kv(inputs.k.to(DEVICE), inputs.v.to(DEVICE), k_cache, v_cache,
                              metadata.slot_mapping.to(DEVICE))
    assert torch.equal(k_cache.cpu(), want_k_cache) and torch.equal(v_cache.cpu(), want_v_cache)
    rows = query_rows(metadata, DEVICE)
    got = triton_attention.paged_attention(inputs.q.to(DEVICE), k_cache, v_cache,
                                           metadata.block_tables.to(DEVICE), rows, scale)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_the_kv_write_reads_k_and_v_as_slices_of_a_fused_row() -> None:
    case = Case("fused", ((1, 9), (3, 3)))
    inputs = make_inputs(case, torch.float32)
    metadata = build(inputs, TritonBackend(case.block_size, case.num_kv_heads))
    qkv = torch.cat([inputs.q, inputs.k, inputs.v], dim=1).to(DEVICE)  # [T, 9 + 3 + 3, D]
    k, v = qkv[:, case.num_heads:case.num_heads + 3], qkv[:, case.num_heads + 3:]
    _, want_k_cache, want_v_cache = expected(inputs, metadata, 0.125)
    k_cache, v_cache = inputs.k_cache.to(DEVICE), inputs.v_cache.to(DEVICE)
    triton_attention.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping.to(DEVICE))
    assert torch.equal(k_cache.cpu(), want_k_cache) and torch.equal(v_cache.cpu(), want_v_cache)


def test_paged_attention_refuses_heads_that_do_not_group() -> None:
    case = Case("odd", ((1, 4),), num_heads=5, num_kv_heads=2)
    inputs = make_inputs(case, torch.float32)
    metadata = build(inputs, TritonBackend(case.block_size, case.num_kv_heads))
    rows = query_rows(metadata, torch.device("cpu"))
    with pytest.raises(ValueError, match="5 query heads for 2 KV heads"):
        triton_attention.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache,
                                         metadata.block_tables, rows, 0.125)


WINDOWED_CASES = [case for case in TRITON_CASES
                  if case.name in ("decode", "mixed", "mixed_block4", "gqa3")]
WINDOWS = [(7, None), (16, None), (None, 2.0), (5, 2.0)]
TILES_CASE = next(case for case in TRITON_CASES if case.name == "tiles")


def test_heads_below_the_dot_tile_go_to_another_backend() -> None:
    case = Case("small_heads", ((1, 4),), head_dim=8)
    inputs = make_inputs(case, torch.float32)
    metadata = build(inputs, TritonBackend(case.block_size, case.num_kv_heads))
    assert not triton_supports(8, case.block_size) and triton_supports(16, case.block_size)
    with pytest.raises(ValueError, match="head_dim at least 16"):
        triton_attention.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache,
                                         metadata.block_tables,
                                         query_rows(metadata, torch.device("cpu")), 0.125)


@pytest.mark.parametrize(("case", "window", "softcap"), [
    *((case, window, softcap) for case in WINDOWED_CASES for window, softcap in WINDOWS),
    (TILES_CASE, 70, None), (TILES_CASE, 100, 2.0)],
    ids=lambda value: getattr(value, "name", str(value)))
def test_windows_and_soft_caps_match_the_reference(case: Case, window: int | None,
                                                   softcap: float | None) -> None:
    inputs = make_inputs(case, torch.float32, seed=7)
    inputs.q.mul_(8)  # scores large enough for the cap to bend them
    metadata = build(inputs, TritonBackend(case.block_size, case.num_kv_heads))
    scale = case.head_dim**-0.5
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, k_cache, v_cache, metadata.slot_mapping)
    want = reference_attention(inputs.q, k_cache, v_cache, metadata, scale, window, softcap)
    got = triton_attention.paged_attention(
        inputs.q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
        metadata.block_tables.to(DEVICE), query_rows(metadata, DEVICE), scale, window, softcap)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
