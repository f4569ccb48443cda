// bf16 values in AVX-512 vectors (where the CPU has AVX512-BF16): 16 at a time to fp32 and
// back (round to nearest even), and 2^t to the precision of values bound for bf16.
#pragma once

#include "avx512.h"

#include <initializer_list>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LOOM_BF16_VECTORS 1

namespace {

constexpr float kLog2e = 1.44269504088896341f;

inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load_bf16(const uint16_t* p) {  // p[0..16)
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The live lanes of p[0..16) (the others read as 0).
inline __m512 load_bf16(const uint16_t* p, __mmask16 live) {
  return widen_bf16(_mm256_maskz_loadu_epi16(live, p));
}

inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// 2^t, t clamped to >= -125 (exp2(-inf) is 2^-125: a weight no sum notices), to 7.5e-5
// relative: a minimax cubic on the fraction, the exponent by vscalefps. The weights become
// bf16, whose own step is 4e-3.
inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(5.517166493e-2f);
  for (const float c : {2.426111219e-1f, 6.932609862e-1f, 9.999280736e-1f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace
#endif
