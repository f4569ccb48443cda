// What the AVX-512 kernels share: lane masks.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// The first n of 16 lanes: none for n <= 0, all for n >= 16.
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

}  // namespace
#endif
