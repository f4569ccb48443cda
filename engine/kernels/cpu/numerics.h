// Numeric helpers every CPU kernel includes: fp32 <-> bf16 (as uint16_t) and an exp in
// plain arithmetic that the compiler vectorizes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return __builtin_bit_cast(float, uint32_t(x) << 16); }
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // round to nearest even; NaN stays NaN
  uint32_t bits = __builtin_bit_cast(uint32_t, x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = uint16_t((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = uint16_t(bits >> 16);
}

// exp(x), x clamped to [-87, 88]: the float range without denormals or infinities. Built with
// -fno-thread-jumps (build.py): with jump threading, g++ evaluates a caller's arithmetic for
// each clamped case in every lane and blends; SiLU's x / (1 + exp(88)) lanes were denormals,
// a microcode assist per vector, and the kernel ran 6x slower than torch's.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

}  // namespace
