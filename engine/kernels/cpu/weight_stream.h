// What the kernels reading 4-bit weight codes share (int4_matmul.cpp, w4a8_matmul.cpp): a
// prefetch of the next chunk of channels, and the float dot product of the offsets' term.
#pragma once

#include "avx2.h"

#include <cstdint>

namespace {

// Touches [start, start + bytes) into L1 ahead of use. A decode step reads each weight once,
// from DRAM: the hardware prefetcher alone restarts at every call and every stream.
inline void prefetch_bytes(const void* start, int64_t bytes) {
#if defined(__AVX2__)
  const char* at = static_cast<const char*>(start);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T0);
#else
  (void)start;
  (void)bytes;
#endif
}

// Channels [first, end)'s codes (k / 2 bytes each), scales and offsets (k / 32 floats each).
inline void prefetch_channels(const uint8_t* q, const float* s, const float* o, int64_t k,
                              int64_t first, int64_t end) {
  if (first >= end) return;
  const int64_t groups = k / 32;
  prefetch_bytes(q + first * k / 2, (end - first) * k / 2);
  prefetch_bytes(s + first * groups, (end - first) * groups * 4);
  prefetch_bytes(o + first * groups, (end - first) * groups * 4);
}

// Σ a·b over n values, in one order (eight lanes, then the rest).
inline float dot(const float* a, const float* b, int64_t n) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX2__)
  __m256 lanes = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8)
    lanes = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lanes);
  total = sum8(lanes);
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

}  // namespace
