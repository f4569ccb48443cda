// y = x Wᵀ for a few fp32 rows of x and a 4-bit weight held as codes: W = q·s + o per group
// of 32 input channels (q in 0..15; the int4 layer's (q - 8)·s + z with o = z - 8·s). A decode
// step reads each weight once, so reading half a byte a weight instead of fp32's four is the
// whole gain; products and sums stay in fp32: float math on the dequantized weight.
//
// Codes: [n][k / 2] bytes, group after group; in a group's 16 bytes, byte b holds code b in
// its low nibble and code b + 16 in its high one (GGUF's Q4_1 order).
#include "avx2.h"

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxRows = 4;
constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 32;  // output channels per OpenMP task
constexpr int64_t kPrefetchChannels = 4;

#if defined(__AVX512F__)
// Σ over the group's 32 codes of q·x, as 16 lanes of partial sums.
inline __m512 group_dot(__m128i bytes, const float* x) {
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0f));
  const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low));
  const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high));
  return _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(x)));
}

template <int kRows>
void channel_codes(const float* xf, int64_t k, const uint8_t* q, const float* s, float* out) {
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m512 scale = _mm512_set1_ps(s[g]);
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm512_fmadd_ps(scale, group_dot(bytes, xf + r * k + g * kGroup), acc[r]);
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#elif defined(__AVX2__)
inline __m256 widen8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

template <int kRows>
void channel_codes(const float* xf, int64_t k, const uint8_t* q, const float* s, float* out) {
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 q0 = widen8(low), q1 = widen8(_mm_srli_si128(low, 8));
    const __m256 q2 = widen8(high), q3 = widen8(_mm_srli_si128(high, 8));
    const __m256 scale = _mm256_set1_ps(s[g]);
    for (int r = 0; r < kRows; ++r) {
      const float* x = xf + r * k + g * kGroup;
      __m256 dot = _mm256_mul_ps(q0, _mm256_loadu_ps(x));
      dot = _mm256_fmadd_ps(q1, _mm256_loadu_ps(x + 8), dot);
      dot = _mm256_fmadd_ps(q2, _mm256_loadu_ps(x + 16), dot);
      dot = _mm256_fmadd_ps(q3, _mm256_loadu_ps(x + 24), dot);
      acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = sum8(acc[r]);
}
#else
template <int kRows>
void channel_codes(const float* xf, int64_t k, const uint8_t* q, const float* s, float* out) {
  for (int r = 0; r < kRows; ++r) {
    float total = 0.f;
    for (int64_t g = 0; g < k / kGroup; ++g) {
      float dot = 0.f;
      for (int64_t b = 0; b < 16; ++b) {
        const uint8_t byte = q[g * 16 + b];
        dot += float(byte & 15) * xf[r * k + g * kGroup + b] +
               float(byte >> 4) * xf[r * k + g * kGroup + b + 16];
      }
      total += s[g] * dot;
    }
    out[r] = total;
  }
}
#endif

template <int kRows>
void matmul(const float* x, const uint8_t* q, const float* s, const float* o, float* y,
            int64_t n, int64_t k, int threads) {
  const int64_t groups = k / kGroup;
  // Σx per group and row: the offsets' share of every channel is Σ_g o_g · Σx_g.
  std::vector<float> group_sums(kRows * groups, 0.f);
  for (int r = 0; r < kRows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < kGroup; ++i) group_sums[r * groups + g] += x[r * k + g * kGroup + i];
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t start = 0; start < n; start += kChunk) {
    for (int64_t j = start; j < std::min(n, start + kChunk); ++j) {
#if defined(__AVX2__) || defined(__AVX512F__)
      if (j + kPrefetchChannels < n) {
        const char* ahead = reinterpret_cast<const char*>(q + (j + kPrefetchChannels) * k / 2);
        for (int64_t line = 0; line < k / 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
#endif
      float out[kRows];
      channel_codes<kRows>(x, k, q + j * k / 2, s + j * groups, out);
      const float* offsets = o + j * groups;
      for (int r = 0; r < kRows; ++r) {
        float shift = 0.f;
        for (int64_t g = 0; g < groups; ++g) shift += offsets[g] * group_sums[r * groups + g];
        y[r * n + j] = out[r] + shift;
      }
    }
  }
}

}  // namespace

// y [rows, n] = x [rows, k] times the 4-bit weight transposed: codes q [n, k / 2] as above,
// scales s and offsets o [n, k / 32], all fp32. 1 when the arguments are out of range.
extern "C" int loom_int4_matmul(const float* x, int64_t rows, const uint8_t* q, const float* s,
                                const float* o, float* y, int64_t n, int64_t k, int threads) {
  if (rows < 1 || rows > kMaxRows || k % kGroup) return 1;
  switch (rows) {
    case 1: matmul<1>(x, q, s, o, y, n, k, threads); break;
    case 2: matmul<2>(x, q, s, o, y, n, k, threads); break;
    case 3: matmul<3>(x, q, s, o, y, n, k, threads); break;
    case 4: matmul<4>(x, q, s, o, y, n, k, threads); break;
  }
  return 0;
}
