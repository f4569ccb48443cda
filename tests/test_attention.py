"""paged_attention against the slow reference, over the mixes the engine produces."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.attention import metadata as attention_metadata
from engine.attention import paged as attention
from engine.attention.metadata import AttentionMetadata
from engine.attention.paged import paged_attention, reference_attention, write_kv


@dataclass(frozen=True)
class Case:
    name: str
    requests: tuple[tuple[int, int], ...]  # (query_len, seq_len), decodes first
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


DECODES = tuple((1, n) for n in (1, 5, 16, 17, 100, 333, 64, 250))
CASES = [
    Case("decode", DECODES),
    Case("decode_one", ((1, 40),)),
    Case("decode_many_lengths", tuple((1, n) for n in range(1, 200, 7))),
    Case("prefill_fresh", ((37, 37),)),
    Case("prefill_fresh_two", ((16, 16), (5, 5))),
    Case("prefill_on_cache", ((20, 53),)),
    Case("prefill_on_cache_aligned", ((16, 48),)),
    Case("mixed", (*DECODES, (30, 30), (12, 90))),
    Case("mixed_mha", ((1, 12), (1, 70), (9, 9), (7, 40)), num_heads=4, num_kv_heads=4),
    Case("mixed_block4", ((1, 3), (1, 21), (1, 8), (6, 6), (5, 13)), block_size=4),
    Case("mqa", ((1, 30), (1, 2), (11, 25)), num_heads=6, num_kv_heads=1, head_dim=32),
    Case("gqa4_dim128", ((1, 70), (1, 3), (1, 129), (9, 40)), num_heads=8, num_kv_heads=2,
         head_dim=128),
    Case("one_token_prompt", ((1, 1), (3, 3))),
    # Beyond KERNEL_PREFILL_MAX_TOKENS: SDPA beside the kernel's rows in one step
    Case("long_prefills_beside_short_ones", ((1, 30), (600, 600), (520, 700), (40, 90))),
]
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# Decode implementations: the C++ kernel, and the torch path's two ways, one with every
# decode in one bucket and one forced to split into several.
DECODE_IMPLS = {
    "cpp": {"CPP_DECODE": True},
    "matmul": {"CPP_DECODE": False, "DECODE_KERNEL": "matmul"},
    "sdpa": {"CPP_DECODE": False, "DECODE_KERNEL": "sdpa"},
    "matmul_buckets": {"CPP_DECODE": False, "DECODE_KERNEL": "matmul",
                       "BUCKET_OVERHEAD_BLOCKS": 0},
    "sdpa_buckets": {"CPP_DECODE": False, "DECODE_KERNEL": "sdpa", "BUCKET_OVERHEAD_BLOCKS": 0},
}


CASE_IMPLS = [
    pytest.param(case, impl, id=f"{case.name}-{impl}")
    for case in CASES
    # Prefill-only cases: the kernel's rows (chunks up to KERNEL_PREFILL_MAX_TOKENS) and SDPA.
    for impl in (DECODE_IMPLS if any(q_len == 1 for q_len, _ in case.requests)
                 else ["cpp", "matmul"])
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Spinning OpenMP workers make a shared, busy machine crawl; one thread keeps this fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def use_decode_impl(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if impl == "cpp":
        assert attention.load_cpp_decode() is not None, "the C++ decode kernel did not build"
    for name, value in DECODE_IMPLS[impl].items():
        planned = name == "BUCKET_OVERHEAD_BLOCKS"  # a knob of the step's plan
        monkeypatch.setattr(attention_metadata if planned else attention, name, value)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> Inputs:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs = case.block_size
    needed = [-(-seq_len // bs) for _, seq_len in case.requests]
    free = list(range(sum(needed) + 7))
    rng.shuffle(free)  # non-contiguous, out-of-order block tables
    tables = [[free.pop() for _ in range(n)] for n in needed]
    slots = [
        table[pos // bs] * bs + pos % bs
        for (query_len, seq_len), table in zip(case.requests, tables, strict=True)
        for pos in range(seq_len - query_len, seq_len)
    ]
    total = len(slots)
    cache_shape = (sum(needed) + 7, case.num_kv_heads, bs, case.head_dim)
    return Inputs(
        q=torch.randn(total, case.num_heads, case.head_dim, dtype=dtype),
        k=torch.randn(total, case.num_kv_heads, case.head_dim, dtype=dtype),
        v=torch.randn(total, case.num_kv_heads, case.head_dim, dtype=dtype),
        # Random (finite) contents stand for cached tokens and for stale slots to be masked.
        k_cache=torch.randn(cache_shape, dtype=dtype),
        v_cache=torch.randn(cache_shape, dtype=dtype),
        query_lens=[query_len for query_len, _ in case.requests],
        seq_lens=[seq_len for _, seq_len in case.requests],
        block_tables=tables,
        slot_mapping=slots,
    )


def build(inputs: Inputs, block_size: int) -> AttentionMetadata:
    return AttentionMetadata.build(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                                   inputs.slot_mapping, block_size, "cpu")


def expected(inputs: Inputs, metadata: AttentionMetadata, scale: float):
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, k_cache, v_cache, metadata.slot_mapping)
    return reference_attention(inputs.q, k_cache, v_cache, metadata, scale), k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("case", "impl"), CASE_IMPLS)
def test_matches_reference(
    case: Case, impl: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
) -> None:
    use_decode_impl(impl, monkeypatch)
    inputs = make_inputs(case, dtype)
    metadata = build(inputs, case.block_size)
    scale = case.head_dim**-0.5
    want, want_k, want_v = expected(inputs, metadata, scale)
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    for _ in range(2):  # a second layer reuses the step's plan and workspaces
        got = paged_attention(inputs.q, inputs.k, inputs.v, k_cache, v_cache, metadata, scale)
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("impl", ["cpp", "matmul"])
def test_several_threads(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_decode_impl(impl, monkeypatch)
    case = Case("threads", (*((1, 40 + 9 * i) for i in range(24)), (17, 17), (9, 50)))
    inputs = make_inputs(case, torch.float32, seed=2)
    metadata = build(inputs, case.block_size)
    want, _, _ = expected(inputs, metadata, 0.125)
    torch.set_num_threads(2)
    got = paged_attention(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", list(DECODE_IMPLS))
def test_views_of_a_fused_qkv_projection(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_decode_impl(impl, monkeypatch)
    case = next(c for c in CASES if c.name == "mixed")
    inputs = make_inputs(case, torch.bfloat16, seed=3)
    heads, kv_heads, dim = case.num_heads, case.num_kv_heads, case.head_dim
    qkv = torch.cat([inputs.q.flatten(1), inputs.k.flatten(1), inputs.v.flatten(1)], dim=1)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    metadata = build(inputs, case.block_size)
    want, _, _ = expected(inputs, metadata, 0.125)
    got = paged_attention(q.view(-1, heads, dim), k.view(-1, kv_heads, dim),
                          v.view(-1, kv_heads, dim), inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, 0.125)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_falls_back_to_torch_when_the_kernel_does_not_compile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("LOOM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(attention, "CPP_DECODE", True)
    attention.load_cpp_library.cache_clear()
    attention.load_cpp_decode.cache_clear()
    try:
        assert attention.load_cpp_decode() is None
        case = next(c for c in CASES if c.name == "decode")
        inputs = make_inputs(case, torch.float32)
        metadata = build(inputs, case.block_size)
        want, _, _ = expected(inputs, metadata, 0.125)
        got = paged_attention(inputs.q, inputs.k, inputs.v, inputs.k_cache, inputs.v_cache,
                              metadata, 0.125)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        attention.load_cpp_library.cache_clear()
        attention.load_cpp_decode.cache_clear()


def test_build_rejects_a_short_block_table() -> None:
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata.build([1], [33], [[0, 1]], [32], 16, "cpu")


def test_metadata_built_by_hand_plans_lazily() -> None:
    case = next(c for c in CASES if c.name == "mixed")
    inputs = make_inputs(case, torch.float32, seed=1)
    built = build(inputs, case.block_size)
    by_hand = AttentionMetadata(built.query_start_loc, built.seq_lens, built.block_tables,
                                built.slot_mapping)
    scale = case.head_dim**-0.5
    want, _, _ = expected(inputs, built, scale)
    got = paged_attention(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                          inputs.v_cache.clone(), by_hand, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_build_fields() -> None:
    metadata = AttentionMetadata.build([1, 1, 3], [5, 17, 3], [[4], [2, 7], [1]],
                                       [4 * 16 + 4, 7 * 16 + 0, 16, 17, 18], 16, "cpu")
    assert metadata.query_start_loc == [0, 1, 2, 5]
    assert metadata.query_lens == [1, 1, 3]
    assert metadata.block_tables.tolist() == [[4, 0], [2, 7], [1, 0]]
    assert metadata.slot_mapping.tolist() == [68, 112, 16, 17, 18]
    assert metadata.num_decodes == 2 and metadata.num_requests == 3


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_puts_each_token_in_its_slot(monkeypatch: pytest.MonkeyPatch, cpp: bool,
                                              dtype: torch.dtype) -> None:
    """Both ways: the C++ copy reads k and v as strided slices of a fused qkv row."""
    monkeypatch.setattr(attention, "CPP_DECODE", cpp)
    block_size, num_kv_heads, head_dim = 4, 2, 8
    k_cache = torch.zeros(6, num_kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = [21, 3, 8, 9, 14]
    qkv = torch.randn(len(slots), 3 * num_kv_heads, head_dim, dtype=dtype)
    k, v = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    assert attention.cpp_write_applies(k, v, k_cache, v_cache) == cpp
    write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    for token, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, :, offset], k[token])
        assert torch.equal(v_cache[block, :, offset], v[token])
    written = {divmod(slot, block_size) for slot in slots}
    for block in range(k_cache.shape[0]):
        for offset in range(block_size):
            if (block, offset) not in written:
                assert not k_cache[block, :, offset].any() and not v_cache[block, :, offset].any()


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "torch"])
def test_write_kv_refuses_a_slot_outside_the_cache(monkeypatch: pytest.MonkeyPatch,
                                                   cpp: bool) -> None:
    monkeypatch.setattr(attention, "CPP_DECODE", cpp)
    k_cache = torch.zeros(2, 1, 4, 8)
    k = torch.randn(1, 1, 8)
    with pytest.raises((IndexError, RuntimeError)):
        write_kv(k, k, k_cache, torch.zeros_like(k_cache), torch.tensor([8]))
    assert not k_cache.any()
