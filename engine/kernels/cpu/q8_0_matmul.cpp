#include "avx2.h"
#include "numerics.h"

#include <algorithm>
#include <cstring>
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

#if defined(__AVX512BF16__)
// The tiled layout (bf16 activations where the CPU multiplies bf16 pairs): 16 output channels
// a tile; per pair of input channels (2i, 2i + 1) the tile's 16 channels' two codes side by
// side, so 32 codes widen to one vector of bf16 pairs (codes are exact in bf16) that
// `vdpbf16ps` multiplies by a row's pair of inputs, 16 channels at once: codes
// [n / 16][k / 2][16][2], scales [n / 16][k / block][16]. Each weight is widened once for
// every row of a pass (up to kMaxTileRows), and no channel needs a horizontal sum.
constexpr int kMaxTileRows = 12;

inline __m512bh widen_pairs(const int8_t* q) {
  return _mm512_cvtne2ps_pbh(widen16(q + 16), widen16(q));
}

// Rows [0, kRows) of x (bf16 [rows][k]) against one tile: out [kRows][16] fp32. A row's sums
// run in one order whatever rows share the pass.
template <int kRows, int kBlock>
void tile(const uint16_t* x, int64_t k, const int8_t* q, const float* d, float* out) {
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m512 part[kRows];
    for (int r = 0; r < kRows; ++r) part[r] = _mm512_setzero_ps();
    for (int p = 0; p < kBlock / 2; ++p) {
      const int64_t pair = b * (kBlock / 2) + p;
      const __m512bh w = widen_pairs(q + pair * 32);
      for (int r = 0; r < kRows; ++r) {
        int32_t inputs;
        std::memcpy(&inputs, x + r * k + 2 * pair, sizeof(inputs));
        part[r] = _mm512_dpbf16_ps(part[r], w, (__m512bh)_mm512_set1_epi32(inputs));
      }
    }
    const __m512 scale = _mm512_loadu_ps(d + b * 16);
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(scale, part[r], acc[r]);
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(out + r * 16, acc[r]);
}

// One or two rows (x widened to fp32, xf [kRows][k]): widening the codes to fp32 costs less
// than to bf16 pairs where so few rows share them. Lanes hold (channel, input 2i or 2i + 1)
// for 8 channels a vector; each channel's two lanes are summed at the end.
template <int kRows, int kBlock>
void tile_fp32(const float* xf, int64_t k, const int8_t* q, const float* d, float* out) {
  const __m512i first_eight = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i last_eight = _mm512_add_epi32(first_eight, _mm512_set1_epi32(8));
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m512 part[kRows][2];
    for (int r = 0; r < kRows; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < kBlock / 2; ++p) {
      const int64_t pair = b * (kBlock / 2) + p;
      const __m512 low = widen16(q + pair * 32), high = widen16(q + pair * 32 + 16);
      for (int r = 0; r < kRows; ++r) {
        double inputs;
        std::memcpy(&inputs, xf + r * k + 2 * pair, sizeof(inputs));
        const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(inputs));
        part[r][0] = _mm512_fmadd_ps(low, xv, part[r][0]);
        part[r][1] = _mm512_fmadd_ps(high, xv, part[r][1]);
      }
    }
    const __m512 scales = _mm512_loadu_ps(d + b * 16);
    const __m512 low_scales = _mm512_permutexvar_ps(first_eight, scales);
    const __m512 high_scales = _mm512_permutexvar_ps(last_eight, scales);
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = _mm512_fmadd_ps(low_scales, part[r][0], acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(high_scales, part[r][1], acc[r][1]);
    }
  }
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int r = 0; r < kRows; ++r) {
    const __m512 low = _mm512_add_ps(acc[r][0], _mm512_permute_ps(acc[r][0], 0xB1));
    const __m512 high = _mm512_add_ps(acc[r][1], _mm512_permute_ps(acc[r][1], 0xB1));
    _mm512_storeu_ps(out + r * 16, _mm512_permutex2var_ps(low, evens, high));
  }
}

// `tile` for rows 3..kMaxTileRows, the row count chosen at run time.
template <int kBlock, int kRows = 3>
void tile_pairs(const uint16_t* x, int64_t rows, int64_t k, const int8_t* q, const float* d,
                float* out) {
  if constexpr (kRows == kMaxTileRows) {
    return tile<kRows, kBlock>(x, k, q, d, out);
  } else {
    if (rows == kRows) return tile<kRows, kBlock>(x, k, q, d, out);
    return tile_pairs<kBlock, kRows + 1>(x, rows, k, q, d, out);
  }
}

template <int kBlock>
void tile_rows(const uint16_t* x, const float* xf, int64_t rows, int64_t k, const int8_t* q,
               const float* d, float* out) {
  if (rows == 1) return tile_fp32<1, kBlock>(xf, k, q, d, out);
  if (rows == 2) return tile_fp32<2, kBlock>(xf, k, q, d, out);
  tile_pairs<kBlock>(x, rows, k, q, d, out);
}

template <int kBlock>
void tiled_matmul(const uint16_t* x, int64_t rows, const int8_t* q, const float* d,
                  uint16_t* y, int64_t n, int64_t k, int threads) {
  const int64_t tiles = (n + 15) / 16, tile_codes = 16 * k, tile_scales = 16 * (k / kBlock);
  std::vector<float> xf(rows * k);  // for passes of one or two rows
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = to_float(x[i]);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t row = 0; row < rows; row += kMaxTileRows) {
      const int64_t count = std::min<int64_t>(kMaxTileRows, rows - row);
      alignas(64) float out[kMaxTileRows * 16];
      tile_rows<kBlock>(x + row * k, xf.data() + row * k, count, k, q + t * tile_codes,
                        d + t * tile_scales, out);
      const int64_t width = std::min<int64_t>(16, n - 16 * t);
      for (int64_t r = 0; r < count; ++r)
        for (int64_t c = 0; c < width; ++c) store(y + (row + r) * n + 16 * t + c, out[r * 16 + c]);
    }
  }
}
#endif

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

// 1 where this build has the tiled kernel (AVX512-BF16), else 0.
extern "C" int loom_q8_0_tiles_built() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// y [rows, n] (bf16) = x [rows, k] (bf16) times the int8 weight in the tiled layout above
// (n padded to whole tiles in the codes and scales, only the first n channels written);
// block 32 or 16. 1 when the arguments are out of range or this build has no tiled kernel.
extern "C" int loom_q8_0_tiles(const void* x, int64_t rows, const int8_t* q, const float* d,
                               void* y, int64_t n, int64_t k, int64_t block, int threads) {
#if defined(__AVX512BF16__)
  if (rows < 1 || (block != 16 && block != 32) || k % block) return 1;
  const auto* xb = static_cast<const uint16_t*>(x);
  auto* yb = static_cast<uint16_t*>(y);
  if (block == 16) tiled_matmul<16>(xb, rows, q, d, yb, n, k, threads);
  else tiled_matmul<32>(xb, rows, q, d, yb, n, k, threads);
  return 0;
#else
  (void)x, (void)rows, (void)q, (void)d, (void)y, (void)n, (void)k, (void)block, (void)threads;
  return 1;
#endif
}
