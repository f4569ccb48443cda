#include "numerics.h"

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
