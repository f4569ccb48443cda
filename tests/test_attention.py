"""The attention backends against the slow reference, over the mixes the engine produces."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.attention import decode_buckets
from engine.attention import metadata as attention_metadata
from engine.attention.base import AttentionBackend
from engine.attention.cpu_backend import CpuBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import reference_attention, write_kv
from engine.attention.selector import select_attention_backend
from engine.attention.torch_backend import TorchBackend
from engine.kernels import paged_decode
from engine.kernels.elementwise import rows_of_contiguous_heads
from engine.kernels.paged_prefill import prefill_kind, tiled_prefill_supports
from engine.platform.cpu import native_bf16_matmul


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
    Case("decode_block32", ((1, 31), (1, 32), (1, 33), (1, 100), (1, 7)), block_size=32),
    Case("mqa", ((1, 30), (1, 2), (11, 25)), num_heads=6, num_kv_heads=1, head_dim=32),
    Case("gqa4_dim128", ((1, 70), (1, 3), (1, 129), (9, 40)), num_heads=8, num_kv_heads=2,
         head_dim=128),
    Case("one_token_prompt", ((1, 1), (3, 3))),
    # Long chunks beside short ones and decodes: the kernel's rows (or the tiled kernel's)
    Case("long_prefills_beside_short_ones", ((1, 30), (600, 600), (520, 700), (40, 90))),
]
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
has_tiled_prefill = tiled_prefill_supports(torch.bfloat16, 64, 16)
needs_tiled_prefill = pytest.mark.skipif(not has_tiled_prefill,
                                         reason="this CPU has neither AMX nor AVX512-BF16")
# Where the CPU has AMX the tiled kernel's products run on tiles and, with LOOM_CPU_AMX=0, in
# vector registers: both are tested there.
PREFILL_PRODUCTS = ["tiles", "vectors"] if prefill_kind() == 2 else ["vectors"]
# Decode implementations: the C++ kernel, and the torch path's two ways, one with every
# decode in one bucket and one forced to split into several.
DECODE_IMPLS = {
    "cpp": {"backend": "cpp"},
    # Where the CPU has AMX, bf16 caches take tiles: this keeps them in vector registers.
    "cpp_vectors": {"backend": "cpp", "LOOM_CPU_AMX": "0"},
    "matmul": {"backend": "torch", "decode_kernel": "matmul"},
    "sdpa": {"backend": "torch", "decode_kernel": "sdpa"},
    "matmul_buckets": {"backend": "torch", "decode_kernel": "matmul",
                       "BUCKET_OVERHEAD_BLOCKS": 0},
    "sdpa_buckets": {"backend": "torch", "decode_kernel": "sdpa", "BUCKET_OVERHEAD_BLOCKS": 0},
}


CASE_IMPLS = [
    pytest.param(case, impl, id=f"{case.name}-{impl}")
    for case in CASES
    # Prefill-only cases: the kernel's rows (or the tiled kernel) and the torch path's SDPA.
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


def backend_for(impl: str, case: Case, monkeypatch: pytest.MonkeyPatch) -> AttentionBackend:
    if impl == "cpp_tiled":  # the tiled prefill kernel for the chunks, beside the decode one
        return CpuBackend(case.block_size, case.num_kv_heads, tiled_prefill=True)
    settings = DECODE_IMPLS[impl]
    if "BUCKET_OVERHEAD_BLOCKS" in settings:  # a knob of the step's plan
        monkeypatch.setattr(decode_buckets, "BUCKET_OVERHEAD_BLOCKS",
                            settings["BUCKET_OVERHEAD_BLOCKS"])
    if "LOOM_CPU_AMX" in settings:
        monkeypatch.setenv("LOOM_CPU_AMX", settings["LOOM_CPU_AMX"])
    if settings["backend"] == "cpp":
        assert paged_decode.load_cpp_decode() is not None, "the C++ decode kernel did not build"
        return CpuBackend(case.block_size, case.num_kv_heads)
    return TorchBackend(case.block_size, case.num_kv_heads, settings["decode_kernel"])


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


def build(inputs: Inputs, backend: AttentionBackend) -> AttentionMetadata:
    return backend.build_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                                  inputs.slot_mapping, "cpu")


def expected(inputs: Inputs, metadata: AttentionMetadata, scale: float,
             window: int | None = None, softcap: float | None = None):
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, k_cache, v_cache, metadata.slot_mapping)
    want = reference_attention(inputs.q, k_cache, v_cache, metadata, scale, window, softcap)
    return want, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("case", "impl"), CASE_IMPLS)
def test_matches_reference(
    case: Case, impl: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = backend_for(impl, case, monkeypatch)
    inputs = make_inputs(case, dtype)
    metadata = build(inputs, backend)
    scale = case.head_dim**-0.5
    want, want_k, want_v = expected(inputs, metadata, scale)
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    for _ in range(2):  # a second layer reuses the step's plan and workspaces
        got = backend.forward(inputs.q, inputs.k, inputs.v, k_cache, v_cache, metadata, scale)
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("impl", ["cpp", "matmul"])
def test_several_threads(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case("threads", (*((1, 40 + 9 * i) for i in range(24)), (17, 17), (9, 50)))
    backend = backend_for(impl, case, monkeypatch)
    inputs = make_inputs(case, torch.float32, seed=2)
    metadata = build(inputs, backend)
    want, _, _ = expected(inputs, metadata, 0.125)
    torch.set_num_threads(2)
    got = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", [*DECODE_IMPLS,
                                  pytest.param("cpp_tiled", marks=needs_tiled_prefill)])
def test_views_of_a_fused_qkv_projection(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in CASES if c.name == "mixed")
    backend = backend_for(impl, case, monkeypatch)
    inputs = make_inputs(case, torch.bfloat16, seed=3)
    heads, kv_heads, dim = case.num_heads, case.num_kv_heads, case.head_dim
    qkv = torch.cat([inputs.q.flatten(1), inputs.k.flatten(1), inputs.v.flatten(1)], dim=1)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    metadata = build(inputs, backend)
    want, _, _ = expected(inputs, metadata, 0.125)
    got = backend.forward(q.view(-1, heads, dim), k.view(-1, kv_heads, dim),
                          v.view(-1, kv_heads, dim), inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, 0.125)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_falls_back_to_torch_when_the_kernel_does_not_compile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("LOOM_KERNEL_CACHE", str(tmp_path))
    paged_decode.load_cpp_library.cache_clear()
    paged_decode.load_cpp_decode.cache_clear()
    try:
        assert paged_decode.load_cpp_decode() is None
        case = next(c for c in CASES if c.name == "decode")
        backend = select_attention_backend(torch.device("cpu"), torch.float32, case.num_heads,
                                           case.num_kv_heads, case.head_dim, case.block_size)
        assert type(backend) is TorchBackend
        inputs = make_inputs(case, torch.float32)
        metadata = build(inputs, backend)
        want, _, _ = expected(inputs, metadata, 0.125)
        got = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache, inputs.v_cache,
                              metadata, 0.125)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        paged_decode.load_cpp_library.cache_clear()
        paged_decode.load_cpp_decode.cache_clear()


def test_the_cpp_backend_is_chosen_where_its_kernel_serves() -> None:
    def choose(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> str:
        return select_attention_backend(torch.device("cpu"), dtype, heads, kv_heads, dim,
                                        16).name

    assert choose(torch.bfloat16, 9, 3, 64) == choose(torch.float32, 8, 8, 128) == "cpu-c++"
    assert choose(torch.float16, 9, 3, 64) == "torch"  # a dtype the kernel does not take
    assert choose(torch.float32, 64, 2, 64) == "torch"  # a query group wider than it holds
    assert choose(torch.float32, 4, 1, 512) == "torch"  # a head wider than it holds


def test_build_rejects_a_short_block_table() -> None:
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata.build([1], [33], [[0, 1]], [32], 16, "cpu")


@pytest.mark.parametrize("impl", ["cpp", "matmul"])
def test_metadata_built_by_hand_is_planned_by_its_backend(
    impl: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = next(c for c in CASES if c.name == "mixed")
    backend = backend_for(impl, case, monkeypatch)
    inputs = make_inputs(case, torch.float32, seed=1)
    built = build(inputs, backend)
    by_hand = AttentionMetadata(built.query_start_loc, built.seq_lens, built.block_tables,
                                built.slot_mapping)
    scale = case.head_dim**-0.5
    want, _, _ = expected(inputs, built, scale)
    with pytest.raises(RuntimeError, match="before its backend planned it"):
        backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                        inputs.v_cache.clone(), by_hand, scale)
    backend.plan(by_hand)
    got = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
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
def test_write_kv_puts_each_token_in_its_slot(cpp: bool, dtype: torch.dtype) -> None:
    """Both ways: the C++ copy reads k and v as strided slices of a fused qkv row."""
    block_size, num_kv_heads, head_dim = 4, 2, 8
    backend = (CpuBackend if cpp else TorchBackend)(block_size, num_kv_heads)
    k_cache = torch.zeros(6, num_kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = [21, 3, 8, 9, 14]
    qkv = torch.randn(len(slots), 3 * num_kv_heads, head_dim, dtype=dtype)
    k, v = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    assert rows_of_contiguous_heads(k) and rows_of_contiguous_heads(v), "read in place"
    backend.write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
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
def test_write_kv_refuses_a_slot_outside_the_cache(cpp: bool) -> None:
    backend = (CpuBackend if cpp else TorchBackend)(4, 1)
    k_cache = torch.zeros(2, 1, 4, 8)
    k = torch.randn(1, 1, 8)
    with pytest.raises((IndexError, RuntimeError)):
        backend.write_kv(k, k, k_cache, torch.zeros_like(k_cache), torch.tensor([8]))
    assert not k_cache.any()


WINDOW_CASES = [case for case in CASES if case.name in (
    "decode", "decode_many_lengths", "prefill_fresh", "prefill_on_cache", "mixed",
    "mixed_block4", "gqa4_dim128", "long_prefills_beside_short_ones", "decode_block32")]
# The C++ kernel's bf16 paths (tiles and vectors) beside the fp32 runs of every path.
WINDOW_IMPLS = [pytest.param(case, impl, dtype, id=f"{case.name}-{impl}-{name}")
                for case in WINDOW_CASES
                for impl, dtype, name in (
                    ("cpp", torch.float32, "fp32"), ("matmul", torch.float32, "fp32"),
                    ("sdpa_buckets", torch.float32, "fp32"), ("cpp", torch.bfloat16, "bf16"),
                    ("cpp_vectors", torch.bfloat16, "bf16"))]


@pytest.mark.parametrize("window", [1, 7, 16, 45, 70])
@pytest.mark.parametrize(("case", "impl", "dtype"), WINDOW_IMPLS)
def test_a_sliding_window_matches_the_reference(case: Case, impl: str, dtype: torch.dtype,
                                                window: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each query sees its last `window` tokens: within a block, across blocks, in decodes,
    the kernel's short prefill rows, fresh and cached prefill chunks."""
    backend = backend_for(impl, case, monkeypatch)
    inputs = make_inputs(case, dtype, seed=5)
    metadata = build(inputs, backend)
    scale = case.head_dim**-0.5
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, k_cache, v_cache, metadata.slot_mapping)
    want = reference_attention(inputs.q, k_cache, v_cache, metadata, scale, window)
    full = reference_attention(inputs.q, k_cache, v_cache, metadata, scale)
    assert torch.allclose(want, full) == (max(inputs.seq_lens) <= window)
    got = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, scale, window)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize(("case", "impl", "dtype"), WINDOW_IMPLS)
def test_soft_capped_scores_match_the_reference(case: Case, impl: str, dtype: torch.dtype,
                                                window: int | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's cap: every scaled score s becomes cap * tanh(s / cap), alone and with a
    window, on every path (SDPA cannot cap: the torch backend computes those explicitly)."""
    backend = backend_for(impl, case, monkeypatch)
    inputs = make_inputs(case, dtype, seed=6)
    inputs.q.mul_(8)  # scores large enough for a cap of 2 to bend them
    metadata = build(inputs, backend)
    scale = case.head_dim**-0.5
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, k_cache, v_cache, metadata.slot_mapping)
    want = reference_attention(inputs.q, k_cache, v_cache, metadata, scale, window, 2.0)
    uncapped = reference_attention(inputs.q, k_cache, v_cache, metadata, scale, window)
    assert not torch.allclose(want.float(), uncapped.float(), atol=1e-1)
    got = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, scale, window, 2.0)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_the_torch_backend_picks_its_decode_kernel_from_device_and_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOOM_CPP_DECODE", "0")

    def decode_kernel(device: str, dtype: torch.dtype) -> str:
        backend = select_attention_backend(torch.device(device), dtype, 9, 3, 64, 16)
        assert type(backend) is TorchBackend
        return backend.decode_kernel

    assert decode_kernel("cpu", torch.float32) == "matmul"
    assert decode_kernel("cpu", torch.float16) == "sdpa"  # no native fp16 GEMMs here
    assert decode_kernel("cpu", torch.bfloat16) == ("matmul" if native_bf16_matmul() else "sdpa")


# The tiled prefill kernel: every case with a prefill chunk it can take (bf16, head_dim a
# multiple of 32, 16-token blocks), every chunk of two rows and more sent to it.
TILED_CASES = [
    *(case for case in CASES if any(query_len > 1 for query_len, _ in case.requests)
      and case.head_dim % 32 == 0 and case.block_size % 16 == 0),
    Case("dim256_on_cache", ((1, 20), (40, 300), (17, 17)), num_heads=4, num_kv_heads=1,
         head_dim=256),
    Case("row_blocks_across_blocks", ((33, 33), (47, 130), (2, 2)), block_size=32),
]


@needs_tiled_prefill
@pytest.mark.parametrize("products", PREFILL_PRODUCTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("window", "softcap"),
                         [(None, None), (7, None), (45, None), (None, 2.0), (16, 2.0)])
@pytest.mark.parametrize("case", TILED_CASES, ids=lambda case: case.name)
def test_the_tiled_prefill_kernel_matches_the_reference(
    case: Case, window: int | None, softcap: float | None, threads: int, products: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fresh chunks and chunks on cached blocks, row blocks cut short by a chunk's end, beside
    decodes and beside each other; windows and caps."""
    monkeypatch.setattr(attention_metadata, "TILED_PREFILL_MIN_TOKENS", 2)
    monkeypatch.setenv("LOOM_CPU_AMX", "1" if products == "tiles" else "0")
    backend = CpuBackend(case.block_size, case.num_kv_heads, tiled_prefill=True)
    inputs = make_inputs(case, torch.bfloat16, seed=7)
    if softcap is not None:
        inputs.q.mul_(8)  # scores large enough for the cap to bend them
    metadata = build(inputs, backend)
    assert metadata.plan is not None and metadata.plan.tiled_prefills is not None
    assert metadata.plan.tiled_prefills.size == sum(q_len > 1 for q_len in inputs.query_lens)
    scale = case.head_dim**-0.5
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, k_cache, v_cache, metadata.slot_mapping)
    want = reference_attention(inputs.q, k_cache, v_cache, metadata, scale, window, softcap)
    torch.set_num_threads(threads)
    got = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, scale, window, softcap)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_long_prefills_go_to_the_tiled_kernel_where_the_cpu_has_amx_or_avx512_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def tiled(dtype: torch.dtype, dim: int = 64, block_size: int = 16) -> bool:
        backend = select_attention_backend(torch.device("cpu"), dtype, 8, 2, dim, block_size)
        return backend.tiled_prefill

    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert tiled(torch.bfloat16) == (
        {"amx_tile", "amx_bf16"} <= flags or {"avx512_bf16", "avx512bw"} <= flags)
    assert tiled(torch.bfloat16, dim=128) == tiled(torch.bfloat16, dim=256) == has_tiled_prefill
    assert not tiled(torch.float32)  # the kernel multiplies bf16 pairs only
    assert not tiled(torch.bfloat16, block_size=8)  # a tile's 16 key rows span two blocks
    assert not tiled(torch.bfloat16, dim=48)  # a tile row holds 32 dims
    monkeypatch.setenv("LOOM_CPU_TILED_PREFILL", "0")
    assert not tiled(torch.bfloat16)


@needs_tiled_prefill
@pytest.mark.parametrize("products", PREFILL_PRODUCTS)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (45, None), (None, 2.0)])
def test_the_tiled_prefill_kernel_gives_a_row_the_same_bits_however_its_prompt_is_chunked(
    window: int | None, softcap: float | None, products: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt of 150 tokens whole, then as its last 111 rows on 39 cached ones beside
    another request: the shared rows' outputs are equal bit for bit (rows land at other
    offsets of their 16-row blocks, and steps are plain or masked differently). The scale is
    not a power of two, so that rounding its products differently would show."""
    monkeypatch.setenv("LOOM_CPU_AMX", "1" if products == "tiles" else "0")
    scale = 80**-0.5
    inputs = make_inputs(Case("whole", ((150, 150),)), torch.bfloat16, seed=9)
    backend = CpuBackend(16, 3, tiled_prefill=True)
    metadata = build(inputs, backend)
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    got_whole = backend.forward(inputs.q, inputs.k, inputs.v, k_cache, v_cache, metadata, scale,
                                window, softcap)
    other = make_inputs(Case("other", ((20, 70),)), torch.bfloat16, seed=10)
    table = inputs.block_tables[0]
    other_table = [block + k_cache.shape[0] for block in other.block_tables[0]]
    slots = [table[pos // 16] * 16 + pos % 16 for pos in range(39, 150)]
    slots += [other_table[pos // 16] * 16 + pos % 16 for pos in range(50, 70)]
    caches = [torch.cat([cache, extra]) for cache, extra in
              ((k_cache, other.k_cache), (v_cache, other.v_cache))]
    split_metadata = backend.build_metadata([111, 20], [150, 70], [table, other_table], slots,
                                            "cpu")
    got_split = backend.forward(
        torch.cat([inputs.q[39:], other.q]), torch.cat([inputs.k[39:], other.k]),
        torch.cat([inputs.v[39:], other.v]), *caches, split_metadata, scale, window, softcap)
    assert torch.equal(got_split[:111], got_whole[39:])


@pytest.mark.parametrize(("dtype", "tiled"), [
    (torch.float32, False), (torch.bfloat16, False),
    pytest.param(torch.bfloat16, True, marks=needs_tiled_prefill)],
    ids=["fp32", "bf16", "bf16-tiled"])
def test_drafted_decodes_are_rows_of_the_decode_kernel_and_match_the_reference(
        tiled: bool, dtype: torch.dtype) -> None:
    """A verified request's rows (its last token and its drafts) are decodes at their own
    positions, beside plain decodes and a prompt chunk, whatever the chunk path is."""
    case = Case("drafted", ((1, 40), (4, 33), (6, 70), (30, 90), (2, 17)))
    backend = CpuBackend(case.block_size, case.num_kv_heads, tiled_prefill=tiled)
    inputs = make_inputs(case, dtype, seed=3)
    drafted = frozenset({1, 2, 4})
    metadata = backend.build_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                                      inputs.slot_mapping, "cpu", row_requests=drafted)
    plan = metadata.plan
    assert plan is not None and plan.kernel_rows is not None
    # The decode and every drafted row; the 30-token prompt chunk goes to the tiled kernel
    # where it serves, else its rows too.
    assert len(plan.kernel_rows.rows) == 1 + 4 + 6 + 2 + (0 if tiled else 30)
    assert drafted <= plan.kernel_prefills
    assert (plan.tiled_prefills is not None and plan.tiled_prefills.size == 1) == tiled
    scale = case.head_dim**-0.5
    want, _, _ = expected(inputs, metadata, scale)
    got = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                          inputs.v_cache.clone(), metadata, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


RUN_CASES = [
    Case("runs", ((1, 40), (4, 33), (6, 70), (30, 90), (2, 17), (17, 17))),
    Case("runs_gqa4_dim128", ((1, 70), (5, 129), (9, 40)), num_heads=8, num_kv_heads=2,
         head_dim=128),
    Case("runs_mha_block32", ((1, 33), (3, 31), (8, 100)), num_heads=4, num_kv_heads=4,
         block_size=32),
    # One stream's verification: too few tasks for two threads, so its run is cut in two.
    Case("one_run", ((7, 300),)),
    Case("one_run_gqa4_dim128", ((5, 150),), num_heads=8, num_kv_heads=2, head_dim=128),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (None, 2.0), (45, None)])
@pytest.mark.parametrize("case", RUN_CASES, ids=lambda case: case.name)
def test_a_requests_rows_read_together_give_each_row_its_bits_alone(
        case: Case, window: int | None, softcap: float | None, threads: int) -> None:
    """fp32: a drafted request's rows and a short prompt chunk's (in runs of up to
    MAX_RUN_ROWS: the 30-row chunk is two) equal, bit for bit, the same rows each read alone,
    and the reference."""
    torch.set_num_threads(threads)
    backend = CpuBackend(case.block_size, case.num_kv_heads)
    inputs = make_inputs(case, torch.float32, seed=5)
    drafted = frozenset(i for i, q_len in enumerate(inputs.query_lens) if 1 < q_len < 8)
    metadata = backend.build_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                                      inputs.slot_mapping, "cpu", row_requests=drafted)
    rows = metadata.plan.kernel_rows
    assert rows is not None and rows.runs is not None
    most = attention_metadata.MAX_RUN_ROWS
    assert rows.runs.diff().tolist() == [min(most, q_len - start) for q_len in inputs.query_lens
                                         for start in range(0, q_len, most)]
    scale = case.head_dim**-0.5
    together = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                               inputs.v_cache.clone(), metadata, scale, window, softcap)
    rows.runs = None
    alone = backend.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache.clone(),
                            inputs.v_cache.clone(), metadata, scale, window, softcap)
    assert torch.equal(together, alone)
    want, _, _ = expected(inputs, metadata, scale, window, softcap)
    torch.testing.assert_close(together, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("runs", [[0, 17, 18], [0, 2, 1, 18], [0, 5, 19]],
                         ids=["too_long", "backwards", "past_the_rows"])
def test_the_decode_kernel_refuses_runs_it_cannot_read(runs: list[int]) -> None:
    case = Case("run", ((18, 18),))
    backend = CpuBackend(case.block_size, case.num_kv_heads)
    inputs = make_inputs(case, torch.float32)
    metadata = build(inputs, backend)
    rows = attention_metadata.plan_rows(metadata, [0], runs=False)
    rows.runs = torch.tensor(runs)
    out = torch.empty_like(inputs.q)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        paged_decode.run_paged_decode(inputs.q, inputs.k_cache, inputs.v_cache, rows,
                                      case.head_dim**-0.5, out)
