"""C++/OpenMP passes around w8a8's int8 GEMM on the CPU (engine.quantized_linear.W8A8Linear):
quantizing activations per token, and scaling the int32 products back to float. Each is one
pass over the data where torch needed several ops and temporaries (at 64 rows x 576 they
took 36-57 µs and 18-55 µs a layer, half what `_int_mm` itself took). Both compute exactly
what the torch ops compute (same divisions, same rounding, same order of products), so the
layer still answers to float math on its fake-quantized activations. Built by
`engine.cpp_build`, loaded through ctypes; without them the layer uses the torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.cpp_build import CPP_NUMERICS, I64, INT, PTR, kernel_supports, load_library

CPP_SOURCE = CPP_NUMERICS + r"""
#include <algorithm>
#include <cfloat>

namespace {

constexpr int64_t kParallelElems = 1 << 15;  // below this, one thread beats waking the rest

// Row r: scale = max |x| / 127 (at least FLT_MIN), q = round-half-even(x / scale) in -127..127.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* q, float* scales,
                   int threads) {
#pragma omp parallel for num_threads(threads) if (rows * k >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * k;
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(to_float(xr[i])));
    float scale = amax / 127.f;
    if (scale < FLT_MIN) scale = FLT_MIN;
    scales[r] = scale;
    int8_t* qr = q + r * k;
    for (int64_t i = 0; i < k; ++i) {
      const float code = std::nearbyint(to_float(xr[i]) / scale);
      qr[i] = int8_t(std::min(127.f, std::max(-127.f, code)));
    }
  }
}

// out[r, j] = float(acc[r, j]) * row_scales[r] * col_scales[j], rounded to T.
template <typename T>
void rescale(const int32_t* acc, int64_t rows, int64_t n, const float* row_scales,
             const float* col_scales, T* out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = row_scales[r];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j)
      store(out + r * n + j, float(acc[r * n + j]) * row_scale * col_scales[j]);
  }
}

}  // namespace

extern "C" void loom_quantize_rows(int is_bf16, const void* x, int64_t rows, int64_t k,
                                   int8_t* q, float* scales, int threads) {
  if (is_bf16)
    quantize_rows(static_cast<const uint16_t*>(x), rows, k, q, scales, threads);
  else
    quantize_rows(static_cast<const float*>(x), rows, k, q, scales, threads);
}

extern "C" void loom_rescale(int is_bf16, const int32_t* acc, int64_t rows, int64_t n,
                             const float* row_scales, const float* col_scales, void* out,
                             int threads) {
  if (is_bf16)
    rescale(acc, rows, n, row_scales, col_scales, static_cast<uint16_t*>(out), threads);
  else
    rescale(acc, rows, n, row_scales, col_scales, static_cast<float*>(out), threads);
}
"""


def kernels_apply(x: torch.Tensor) -> bool:
    return x.dim() == 2 and kernel_supports(x) and load_w8a8_kernels() is not None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a int8 [M, K], t float32 [M, 1]) with x ≈ a·t, as W8A8Linear.quantize_input."""
    library = load_w8a8_kernels()
    assert library is not None
    rows, k = x.shape
    codes = torch.empty((rows, k), dtype=torch.int8)
    scales = torch.empty((rows, 1), dtype=torch.float32)
    library.loom_quantize_rows(int(x.dtype is torch.bfloat16), x.data_ptr(), rows, k,
                               codes.data_ptr(), scales.data_ptr(), torch.get_num_threads())
    return codes, scales


def rescale(acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """(acc.float() * row_scales * col_scales).to(dtype): acc int32 [M, N] contiguous,
    row_scales float32 [M, 1], col_scales float32 [N]."""
    library = load_w8a8_kernels()
    assert library is not None
    rows, n = acc.shape
    if not (acc.dtype is torch.int32 and acc.is_contiguous() and row_scales.numel() == rows
            and col_scales.numel() == n and col_scales.dtype is torch.float32):
        raise ValueError(f"w8a8 rescale: acc {tuple(acc.shape)} {acc.dtype}, "
                         f"scales {tuple(row_scales.shape)} / {tuple(col_scales.shape)}")
    out = torch.empty((rows, n), dtype=dtype)
    library.loom_rescale(int(dtype is torch.bfloat16), acc.data_ptr(), rows, n,
                         row_scales.contiguous().data_ptr(), col_scales.data_ptr(),
                         out.data_ptr(), torch.get_num_threads())
    return out


@functools.cache
def load_w8a8_kernels() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the kernels; None, logged, when that fails."""
    return load_library("w8a8", CPP_SOURCE, "torch ops", {
        "loom_quantize_rows": ([INT, PTR, I64, I64, PTR, PTR, INT], None),
        "loom_rescale": ([INT, PTR, I64, I64, PTR, PTR, PTR, INT], None),
    })
