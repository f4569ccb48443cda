// What the AVX-512 kernels share: lane masks and a 16 x 16 transpose in registers.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// The first n of 16 lanes: none for n <= 0, all for n >= 16.
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// rows[i] lane j -> rows[j] lane i, for 16 rows of 16 floats: pairs, then quads interleaved
// within 128-bit lanes, then the 4 x 4 blocks of lanes.
inline void transpose16(__m512 rows[16]) {
  __m512 pairs[16], quads[16];
  for (int k = 0; k < 16; k += 2) {
    pairs[k] = _mm512_unpacklo_ps(rows[k], rows[k + 1]);
    pairs[k + 1] = _mm512_unpackhi_ps(rows[k], rows[k + 1]);
  }
  for (int k = 0; k < 16; k += 4)  // quads[k + m], lane L: rows k..k+3 at column 4L + m
    for (int half = 0; half < 2; ++half) {
      const __m512d a = _mm512_castps_pd(pairs[k + half]), b = _mm512_castps_pd(pairs[k + 2 + half]);
      quads[k + 2 * half] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      quads[k + 2 * half + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int m = 0; m < 4; ++m) {  // rows[4L + m] = lane L of quads[m], [4 + m], [8 + m], [12 + m]
    const __m512 low01 = _mm512_shuffle_f32x4(quads[m], quads[4 + m], 0x44);
    const __m512 high01 = _mm512_shuffle_f32x4(quads[m], quads[4 + m], 0xEE);
    const __m512 low23 = _mm512_shuffle_f32x4(quads[8 + m], quads[12 + m], 0x44);
    const __m512 high23 = _mm512_shuffle_f32x4(quads[8 + m], quads[12 + m], 0xEE);
    rows[m] = _mm512_shuffle_f32x4(low01, low23, 0x88);
    rows[4 + m] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
    rows[8 + m] = _mm512_shuffle_f32x4(high01, high23, 0x88);
    rows[12 + m] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
  }
}

// The same for 16 rows of 16 32-bit integers (or bytes in fours).
inline void transpose16(__m512i rows[16]) { transpose16(reinterpret_cast<__m512*>(rows)); }

}  // namespace
#endif
