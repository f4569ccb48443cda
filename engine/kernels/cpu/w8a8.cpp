#include "numerics.h"

#include <algorithm>
#include <cfloat>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

constexpr int64_t kChannelChunk = 16;  // output channels per OpenMP task
constexpr int kRowBlock = 4;  // rows sharing one pass over a chunk's weights

// Σ_k a[r][k]·w[c][k] in int32 for kRows rows and kChannels channels: exact, as torch._int_mm.
// AVX2 multiplies unsigned by signed bytes only, so each product is |w|·(a with w's sign)
// (`maddubs`: pairs of products summed in 16 bits, at most 2·127·127 < 2¹⁵), widened to 32.
template <int kRows, int kChannels>
void dot_block(const int8_t* a, const int8_t* w, int64_t k, int32_t* out, int64_t n) {
  int64_t i = 0;
  int32_t tail[kRows][kChannels] = {};
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[kRows][kChannels];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChannels; ++c) acc[r][c] = _mm256_setzero_si256();
  for (; i + 32 <= k; i += 32) {
    for (int c = 0; c < kChannels; ++c) {
      const __m256i weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * k + i));
      const __m256i magnitudes = _mm256_sign_epi8(weights, weights);
      for (int r = 0; r < kRows; ++r) {
        const __m256i inputs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * k + i));
        const __m256i pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(inputs, weights));
        acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChannels; ++c) {
      __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(acc[r][c]),
                                  _mm256_extracti128_si256(acc[r][c], 1));
      sum = _mm_hadd_epi32(sum, sum);
      tail[r][c] = _mm_cvtsi128_si32(_mm_hadd_epi32(sum, sum));
    }
#endif
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChannels; ++c) {
      int32_t total = tail[r][c];
      for (int64_t j = i; j < k; ++j) total += int32_t(a[r * k + j]) * int32_t(w[c * k + j]);
      out[r * n + c] = total;
    }
}

template <int kRows>
void channel_span(const int8_t* a, const int8_t* w, int64_t k, int32_t* out, int64_t n,
                  int64_t first, int64_t end) {
  constexpr int kWide = kRows <= 2 ? 4 : 2;  // sums held in registers: kRows x kWide
  int64_t c = first;
  for (; c + kWide <= end; c += kWide) dot_block<kRows, kWide>(a, w + c * k, k, out + c, n);
  for (; c < end; ++c) dot_block<kRows, 1>(a, w + c * k, k, out + c, n);
}

// out [rows, n] = a [rows, k] times w [n, k] transposed, int8 in, int32 out.
void int8_matmul(const int8_t* a, int64_t rows, const int8_t* w, int32_t* out, int64_t n,
                 int64_t k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n * k >= kParallelElems * 64)
  for (int64_t first = 0; first < n; first += kChannelChunk) {
    const int64_t end = std::min(n, first + kChannelChunk);
    for (int64_t row = 0; row < rows; row += kRowBlock) {
      const int8_t* block = a + row * k;
      int32_t* block_out = out + row * n;
      switch (std::min<int64_t>(kRowBlock, rows - row)) {
        case 1: channel_span<1>(block, w, k, block_out, n, first, end); break;
        case 2: channel_span<2>(block, w, k, block_out, n, first, end); break;
        case 3: channel_span<3>(block, w, k, block_out, n, first, end); break;
        default: channel_span<4>(block, w, k, block_out, n, first, end); break;
      }
    }
  }
}

}  // namespace

// out [rows, n] = a [rows, k] · w [n, k]ᵀ in int32 (torch._int_mm(a, w.T), whose CPU kernel
// runs at ~2-3 G products/s where oneDNN has no VNNI or AMX int8 path).
extern "C" void loom_int8_matmul(const int8_t* a, int64_t rows, const int8_t* w, int32_t* out,
                                 int64_t n, int64_t k, int threads) {
  int8_matmul(a, rows, w, out, n, k, threads);
}

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
