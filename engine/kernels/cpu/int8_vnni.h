// An int8 cache's keys in integer products (AVX512-VNNI's vpdpbusd: four u8 x s8 products
// summed into each 32-bit lane), with no code widened to fp32.
//
// A query head becomes 15-bit integers (its largest value 16383), each split into a signed
// high byte and a low byte in [0, 128); 16 key rows, flipped to unsigned (code + 128), are
// transposed in fours of codes, so one vpdpbusd adds four dims of 16 tokens. The flip's
// 128 x sum(query) comes off once; the sums are exact, so a score carries only the query's
// rounding (2^-15 of its largest value).
#pragma once

#include "avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr float kQueryTop = 16383.f;  // the largest query value as an integer (15 bits)

template <int kDim>
struct QueryCodes {
  int8_t high[kDim];  // q >> 7, in [-128, 128)
  int8_t low[kDim];   // q & 127
  float scale;        // the query's value of 1
  int32_t bias;       // 128 x sum(q): the flipped keys' excess
};

template <int kDim>
inline void code_query(const float* query, QueryCodes<kDim>& out) {
  float top = 0.f;
  for (int d = 0; d < kDim; ++d) top = std::max(top, std::fabs(query[d]));
  const float to_int = top > 0.f ? kQueryTop / top : 0.f;
  int32_t sum = 0;
  for (int d = 0; d < kDim; ++d) {
    const int32_t v = int32_t(std::lrintf(query[d] * to_int));
    out.high[d] = int8_t(v >> 7);
    out.low[d] = int8_t(v & 127);
    sum += v;
  }
  out.scale = top / kQueryTop;
  out.bias = 128 * sum;
}

}  // namespace

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LOOM_INT8_VNNI 1

namespace {

inline __m512i broadcast_four(const int8_t* p) {
  int32_t four;
  __builtin_memcpy(&four, p, 4);
  return _mm512_set1_epi32(four);
}

// The group's query heads dotted with 16 rows' codes (rows `kRowBytes` apart), before the
// rows' scales; fetch(t) is called as row t is read (spread over the products instead, the
// fetches came too late: 1.4x slower over a cache in memory).
template <int kDim, int kGroup, int64_t kRowBytes, typename Fetch>
inline void int8_dots16(const int8_t* rows, const QueryCodes<kDim>* query, __m512 out[kGroup],
                        Fetch fetch) {
  const __m512i flip = _mm512_set1_epi8(-128);
  __m512i high[kGroup], low[kGroup];
  for (int g = 0; g < kGroup; ++g) high[g] = low[g] = _mm512_setzero_si512();
  for (int part = 0; part < kDim; part += 64) {
    __m512i fours[16];  // after the transpose: fours[j] lane t = row t's codes 4j..4j+3
    for (int t = 0; t < 16; ++t) {
      if (part == 0) fetch(t);
      fours[t] = _mm512_xor_si512(_mm512_loadu_si512(rows + t * kRowBytes + part), flip);
    }
    transpose16(fours);
    for (int g = 0; g < kGroup; ++g)
      for (int j = 0; j < 16; ++j) {
        const int64_t at = part + 4 * j;
        high[g] = _mm512_dpbusd_epi32(high[g], fours[j], broadcast_four(query[g].high + at));
        low[g] = _mm512_dpbusd_epi32(low[g], fours[j], broadcast_four(query[g].low + at));
      }
  }
  for (int g = 0; g < kGroup; ++g) {
    const __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(high[g], 7), low[g]);
    const __m512i dots = _mm512_sub_epi32(sums, _mm512_set1_epi32(query[g].bias));
    out[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(query[g].scale));
  }
}

}  // namespace
#endif
