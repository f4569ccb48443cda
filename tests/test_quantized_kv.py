"""The 8-bit KV cache (engine.attention.quantized_kv): its rows' codes and scales, the rotation,
and every attention path over such a cache against the reference on the same codes."""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from engine.attention.cpu_backend import CpuBackend
from engine.attention.metadata import DecodeBatch
from engine.attention.quantized_kv import (
    SCALE_BYTES,
    cache_dtype,
    dequantize_rows,
    hadamard,
    quantize_rows,
    rotate,
    row_width,
)
from engine.attention.reference import reference_attention, write_kv
from engine.attention.selector import select_attention_backend
from engine.attention.torch_backend import TorchBackend
from engine.executor.model_runner import kv_bytes_per_block
from engine.kernels import paged_decode
from tests.test_attention import CASES, Case, Inputs, make_inputs, one_thread  # noqa: F401

CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# The C++ kernel and the torch path read every kind; the torch path's decodes run as
# explicit matmuls or SDPA.
IMPLS = [(impl, codes) for impl in ("cpp", "matmul", "sdpa") for codes in CODES]
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def quantized(inputs: Inputs, codes: torch.dtype) -> Inputs:
    """The inputs with caches of rows of `codes` (their random contents as codes)."""
    def convert(cache: torch.Tensor) -> torch.Tensor:
        *shape, head_dim = cache.shape
        rows = quantize_rows(cache.reshape(-1, head_dim), codes)
        return rows.view(*shape, head_dim + SCALE_BYTES)

    inputs.k_cache, inputs.v_cache = convert(inputs.k_cache), convert(inputs.v_cache)
    return inputs


def backend(impl: str, case: Case) -> TorchBackend:
    if impl == "cpp":
        assert paged_decode.load_cpp_decode() is not None, "the C++ decode kernel did not build"
        return CpuBackend(case.block_size, case.num_kv_heads)
    return TorchBackend(case.block_size, case.num_kv_heads, impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("impl", "codes"), IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_attention_over_an_8bit_cache_matches_the_reference_on_its_codes(
        case: Case, impl: str, codes: str, dtype: torch.dtype) -> None:
    attention = backend(impl, case)
    inputs = quantized(make_inputs(case, dtype), CODES[codes])
    metadata = attention.build_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                                        inputs.slot_mapping, "cpu")
    scale = case.head_dim**-0.5
    want_k, want_v = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, want_k, want_v, metadata.slot_mapping)
    want = reference_attention(inputs.q, want_k, want_v, metadata, scale)
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    got = attention.forward(inputs.q, inputs.k, inputs.v, k_cache, v_cache, metadata, scale)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    # The C++ write makes the bits the torch quantizer makes.
    assert torch.equal(k_cache.view(torch.int8), want_k.view(torch.int8))
    assert torch.equal(v_cache.view(torch.int8), want_v.view(torch.int8))


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (45, None), (None, 2.0), (16, 3.0)])
@pytest.mark.parametrize("impl", ["cpp", "matmul"])
def test_windows_soft_caps_and_drafted_rows_over_an_int8_cache(
        impl: str, window: int | None, softcap: float | None) -> None:
    case = Case("drafted", ((1, 40), (4, 33), (6, 70), (30, 90), (2, 17)))
    attention = backend(impl, case)
    inputs = quantized(make_inputs(case, torch.float32, seed=3), torch.int8)
    metadata = attention.build_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                                        inputs.slot_mapping, "cpu",
                                        row_requests=frozenset({1, 2, 4}))
    scale = case.head_dim**-0.5
    want_k, want_v = inputs.k_cache.clone(), inputs.v_cache.clone()
    write_kv(inputs.k, inputs.v, want_k, want_v, metadata.slot_mapping)
    want = reference_attention(inputs.q, want_k, want_v, metadata, scale, window, softcap)
    got = attention.forward(inputs.q, inputs.k, inputs.v, inputs.k_cache, inputs.v_cache,
                            metadata, scale, window, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 2, 128, 16), (8, 1, 64, 32), (4, 4, 64, 16)])
@pytest.mark.parametrize("outlier", [False, True], ids=["plain", "outlier"])
def test_bf16_queries_over_int8_keys_score_as_fp32_queries_do(
        heads: int, kv_heads: int, head_dim: int, block_size: int, outlier: bool) -> None:
    """bf16 queries over an int8 cache take integer products where the CPU has AVX512-VNNI
    (each query head on a 15-bit grid of its largest value, the sums exact): the outputs
    must be fp32 products' on the same grid's query (or on the query itself, without them),
    to the bf16 output's rounding. `outlier`: one dim of every query 100x the rest."""
    assert paged_decode.load_cpp_decode() is not None, "the C++ decode kernel did not build"
    torch.manual_seed(11)
    seq_lens = [1, 2, 15, 16, 17, 40, 64, 100, 129, 300]
    per_request = -(-max(seq_lens) // block_size)
    num_blocks = per_request * len(seq_lens)
    def cache() -> torch.Tensor:
        rows = quantize_rows(torch.randn(num_blocks * kv_heads * block_size, head_dim), torch.int8)
        return rows.view(num_blocks, kv_heads, block_size, head_dim + SCALE_BYTES)
    k_cache, v_cache = cache(), cache()
    tables = torch.randperm(num_blocks).view(len(seq_lens), per_request)
    batch = DecodeBatch(rows=list(range(len(seq_lens))), seq_lens=seq_lens,
                        row_index=torch.arange(len(seq_lens)), lens=torch.tensor(seq_lens),
                        block_tables=tables, max_block=num_blocks - 1)
    q = (torch.randn(len(seq_lens), heads, head_dim) * 3).bfloat16()
    if outlier:
        q[..., 5] *= 100
    scale = head_dim**-0.5
    as_scored = paged_decode.query_as_coded(q, scale) if paged_decode.int8_key_products() else q
    want = torch.empty(q.shape)
    paged_decode.run_paged_decode(as_scored.float(), k_cache, v_cache, batch, scale, want)
    got = torch.empty(q.shape, dtype=torch.bfloat16)
    paged_decode.run_paged_decode(q, k_cache, v_cache, batch, scale, got)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2.0**-8)


@pytest.mark.parametrize("head_dim", [64, 256], ids=["vector", "scalar"])
@pytest.mark.parametrize("codes", list(CODES))
def test_the_kernel_reads_every_code_as_torch_converts_it(codes: str, head_dim: int) -> None:
    """One-token requests whose value rows hold all 256 codes (less fp8's NaN and infinities):
    each output is its value row exactly, so the kernel's own widening of codes shows."""
    assert paged_decode.load_cpp_decode() is not None, "the C++ decode kernel did not build"
    dtype = CODES[codes]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    every = every[every.view(dtype).float().isfinite()]
    requests = -(-len(every) // head_dim)
    codes_per_row = torch.zeros(requests * head_dim, dtype=torch.uint8)
    codes_per_row[:len(every)] = every
    v_cache = torch.zeros(requests, 1, 16, head_dim + SCALE_BYTES, dtype=torch.uint8)
    v_cache[:, 0, 0, :head_dim] = codes_per_row.view(requests, head_dim)
    v_cache[:, 0, 0, head_dim:] = torch.tensor([0.5]).view(torch.uint8)  # every scale 0.5
    v_cache = v_cache.view(dtype)
    batch = DecodeBatch(rows=list(range(requests)), seq_lens=[1] * requests,
                        row_index=torch.arange(requests), lens=torch.ones(requests).long(),
                        block_tables=torch.arange(requests).view(requests, 1),
                        max_block=requests - 1)
    out = torch.empty(requests, 1, head_dim)
    paged_decode.run_paged_decode(torch.randn(requests, 1, head_dim), v_cache.clone(), v_cache,
                                  batch, head_dim**-0.5, out)
    assert torch.equal(out.flatten(), codes_per_row.view(dtype).float() * 0.5)


@pytest.mark.parametrize("codes", list(CODES))
def test_a_row_comes_back_within_half_a_step_of_its_codes(codes: str) -> None:
    dtype = CODES[codes]
    x = torch.randn(50, 64) * torch.logspace(-3, 2, 50)[:, None]
    x[7] = 0.0
    rows = quantize_rows(x, dtype)
    assert rows.shape == (50, 64 + SCALE_BYTES) and rows.dtype == dtype
    back = dequantize_rows(rows, torch.float32)
    assert torch.equal(back[7], torch.zeros(64))
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:  # uniform steps of amax / 127
        assert ((back - x).abs() <= amax / 127 / 2 * (1 + 1e-6)).all()
    else:  # 3 (e4m3) or 2 (e5m2) mantissa bits: half a step relative to each value
        mantissa = 3 if dtype == torch.float8_e4m3fn else 2
        assert ((back - x).abs() <= x.abs() * 2.0 ** -(mantissa + 1) + amax * 1e-6).all()
    assert (back.abs().amax(-1, keepdim=True) - amax).abs().max() <= amax.max() * 1e-6


@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128, 256])
def test_the_rotation_is_orthonormal_and_its_own_inverse(head_dim: int) -> None:
    matrix = hadamard(head_dim, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(matrix @ matrix, torch.eye(head_dim), atol=1e-6, rtol=0)
    x = torch.randn(5, 3, head_dim)
    torch.testing.assert_close(rotate(rotate(x)), x, atol=1e-5, rtol=1e-5)
    # A channel far larger than the rest is spread over all of them.
    spike = torch.zeros(head_dim)
    spike[3] = 10.0
    assert rotate(spike).abs().max() < 10.0 / 3


def test_8bit_rows_hold_about_twice_the_tokens_of_bf16_and_four_times_fp32() -> None:
    assert row_width(64, torch.int8) == 68 and row_width(64, torch.float32) == 64
    int8 = kv_bytes_per_block(30, 3, 64, 16, torch.int8)
    assert kv_bytes_per_block(30, 3, 64, 16, torch.bfloat16) / int8 == 128 / 68
    assert kv_bytes_per_block(30, 3, 64, 16, torch.float32) / int8 == 256 / 68
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn


def test_the_backend_for_an_8bit_cache() -> None:
    cpu = torch.device("cpu")
    int8 = select_attention_backend(cpu, torch.bfloat16, 9, 3, 64, 16, cache_dtype=torch.int8)
    assert isinstance(int8, CpuBackend) and not int8.tiled_prefill  # AMX tiles take bf16 only
    fp8 = select_attention_backend(cpu, torch.float32, 9, 3, 64, 16,
                                   cache_dtype=torch.float8_e5m2)
    assert isinstance(fp8, CpuBackend)
    cuda_like = select_attention_backend(torch.device("meta"), torch.float32, 9, 3, 64, 16,
                                         cache_dtype=torch.int8)
    assert type(cuda_like) is TorchBackend


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="x", kv_cache_dtype="int4")
