#include "avx2.h"
#include "numerics.h"

#include <algorithm>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxRows = 4;  // rows per pass over a channel, one accumulator each
constexpr int64_t kChunk = 64;  // output channels per OpenMP task
// Channels to prefetch ahead: with a few KB in flight a core streams the codes at ~20 GB/s
// instead of the hardware prefetcher's ~15 (a decode step reads each weight once, from DRAM).
constexpr int64_t kPrefetchChannels = 4;

#if defined(__AVX512F__)
inline __m512 widen16(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// Output channel j for every row of xf (fp32, [rows][k]); one scale per kBlock codes.
template <int kRows, int kBlock>
void channel(const float* xf, int64_t k, const int8_t* q, const float* d, float* out) {
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 scale = _mm512_set1_ps(d[b]);
    const __m512 w0 = widen16(q + b * kBlock);
    if constexpr (kBlock == 32) {
      const __m512 w1 = widen16(q + b * kBlock + 16);
      for (int r = 0; r < kRows; ++r) {
        const float* x = xf + r * k + b * kBlock;
        const __m512 dot = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16),
                                           _mm512_mul_ps(w0, _mm512_loadu_ps(x)));
        acc[r] = _mm512_fmadd_ps(scale, dot, acc[r]);
      }
    } else {
      for (int r = 0; r < kRows; ++r) {
        const __m512 dot = _mm512_mul_ps(w0, _mm512_loadu_ps(xf + r * k + b * kBlock));
        acc[r] = _mm512_fmadd_ps(scale, dot, acc[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#elif defined(__AVX2__)
inline __m256 widen8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

template <int kRows, int kBlock>
void channel(const float* xf, int64_t k, const int8_t* q, const float* d, float* out) {
  constexpr int kParts = kBlock / 8;
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 w[kParts];
    for (int p = 0; p < kParts; ++p) w[p] = widen8(q + b * kBlock + 8 * p);
    const __m256 scale = _mm256_set1_ps(d[b]);
    for (int r = 0; r < kRows; ++r) {
      const float* x = xf + r * k + b * kBlock;
      __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
      for (int p = 1; p < kParts; ++p) dot = _mm256_fmadd_ps(w[p], _mm256_loadu_ps(x + 8 * p), dot);
      acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = sum8(acc[r]);
}
#else
template <int kRows, int kBlock>
void channel(const float* xf, int64_t k, const int8_t* q, const float* d, float* out) {
  for (int r = 0; r < kRows; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < k / kBlock; ++b) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < kBlock; ++i)
        dot += float(q[b * kBlock + i]) * xf[r * k + b * kBlock + i];
      total += d[b] * dot;
    }
    out[r] = total;
  }
}
#endif

// Rows [0, rows <= kMaxRows) of xf against one channel; each row's sum in the same order for
// any number of rows beside it.
template <int kBlock>
void channel_rows(const float* xf, int64_t rows, int64_t k, const int8_t* q, const float* d,
                  float* out) {
  switch (rows) {
    case 1: return channel<1, kBlock>(xf, k, q, d, out);
    case 2: return channel<2, kBlock>(xf, k, q, d, out);
    case 3: return channel<3, kBlock>(xf, k, q, d, out);
    default: return channel<4, kBlock>(xf, k, q, d, out);
  }
}

template <typename T, int kBlock>
void matmul(const T* x, int64_t rows, const int8_t* q, const float* d, T* y, int64_t n,
            int64_t k, int threads) {
  std::vector<float> xf(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xf[i] = to_float(x[i]);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t start = 0; start < n; start += kChunk) {
    for (int64_t j = start; j < std::min(n, start + kChunk); ++j) {
#if defined(__AVX2__) || defined(__AVX512F__)
      if (j + kPrefetchChannels < n) {
        const char* ahead = reinterpret_cast<const char*>(q + (j + kPrefetchChannels) * k);
        for (int64_t line = 0; line < k; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
#endif
      for (int64_t row = 0; row < rows; row += kMaxRows) {
        const int64_t count = std::min<int64_t>(kMaxRows, rows - row);
        float out[kMaxRows];
        channel_rows<kBlock>(xf.data() + row * k, count, k, q + j * k, d + j * (k / kBlock),
                             out);
        for (int64_t r = 0; r < count; ++r) store(y + (row + r) * n + j, out[r]);
      }
    }
  }
}

template <typename T>
void dispatch_block(const T* x, int64_t rows, const int8_t* q, const float* d, T* y,
                    int64_t n, int64_t k, int64_t block, int threads) {
  if (block == 16) return matmul<T, 16>(x, rows, q, d, y, n, k, threads);
  return matmul<T, 32>(x, rows, q, d, y, n, k, threads);
}

}  // namespace

// y [rows, n] = x [rows, k] times the int8 weight (codes q [n, k], scales d [n, k / block],
// block 32 (Q8_0, Q5_0) or 16 (Q6_K)) transposed; x and y bf16 (is_bf16) or fp32. 1 when the
// arguments are out of range.
extern "C" int loom_q8_0_matmul(int is_bf16, const void* x, int64_t rows, const int8_t* q,
                                const float* d, void* y, int64_t n, int64_t k, int64_t block,
                                int threads) {
  if (rows < 1 || (block != 16 && block != 32) || k % block) return 1;
  if (is_bf16)
    dispatch_block(static_cast<const uint16_t*>(x), rows, q, d, static_cast<uint16_t*>(y), n,
                   k, block, threads);
  else
    dispatch_block(static_cast<const float*>(x), rows, q, d, static_cast<float*>(y), n, k,
                   block, threads);
  return 0;
}
