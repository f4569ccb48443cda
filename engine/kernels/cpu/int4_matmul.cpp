// y = x Wᵀ for fp32 rows of x and a 4-bit weight held as codes: W = q·s + o per group of 32
// input channels (q in 0..15; the int4 layer's (q - 8)·s + z with o = z - 8·s). Reading half a
// byte a weight instead of fp32's four is the gain while a step is memory-bound; products and
// sums stay in fp32: float math on the dequantized weight.
//
// A row's sums run in one fixed order whatever the other rows, their number and the threads
// (each output computed whole by one thread, no split over k): a row's bits never depend on
// what shares its step.
//
// Codes: [n][k / 2] bytes, group after group; in a group's 16 bytes, byte b holds code b in
// its low nibble and code b + 16 in its high one (GGUF's Q4_1 order).
#include "weight_stream.h"

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int kRowBlock = 8;      // rows sharing one pass over a channel's codes
constexpr int64_t kChunk = 16;    // output channels per OpenMP task

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
using Bytes = __m512i;  // a group's 16 bytes, one per 32-bit lane
inline Bytes load_bytes(const uint8_t* group, int /*half: one holds the group*/) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
}
// Codes part·16 .. part·16 + 15 of a group (low nibbles, then high).
inline Vec codes_of(Bytes bytes, int part) {
  const __m512i codes = part == 0 ? _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f))
                                  : _mm512_srli_epi32(bytes, 4);
  return _mm512_cvtepi32_ps(codes);
}
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
constexpr int kHalves = 1;
#elif defined(__AVX2__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return sum8(v); }
using Bytes = __m256i;  // 8 of a group's bytes, one per 32-bit lane
// Bytes half·8 .. half·8 + 7 of a group, widened as they load (no shuffle of a loaded xmm).
inline Bytes load_bytes(const uint8_t* group, int half) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + 8 * half)));
}
// Codes part·8 .. part·8 + 7 of a group, from the bytes of half part % 2 (low nibbles for
// parts 0-1, high for 2-3).
inline Vec codes_of(Bytes bytes, int part) {
  const __m256i codes = part < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0f))
                                 : _mm256_srli_epi32(bytes, 4);
  return _mm256_cvtepi32_ps(codes);
}
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
constexpr int kHalves = 2;
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
// Σ_g s_g · Σ_{k in g} q·x for kChannels channels (codes q and scales s one channel's worth
// apart) and kRows rows of x; out[c * kRows + r]. A group's products are summed first and then
// scaled once into the row's total: one multiply by the scale a group, not one per eight codes
// (the kernel is bound by its arithmetic, not by memory). Each row's sum runs in the same order
// for any kRows.
template <int kChannels, int kRows>
void block(const float* x, int64_t k, const uint8_t* q, const float* s, float* out) {
  constexpr int kParts = kGroup / kLanes;
  const int64_t groups = k / kGroup;
  Vec acc[kChannels][kRows];
  for (int c = 0; c < kChannels; ++c)
    for (int r = 0; r < kRows; ++r) acc[c][r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < kChannels; ++c) {
      Vec w[kParts];
      for (int half = 0; half < kHalves; ++half) {
        const Bytes bytes = load_bytes(q + c * k / 2 + g * 16, half);
        for (int part = half; part < kParts; part += kHalves) w[part] = codes_of(bytes, part);
      }
      const Vec scale = vset(s[c * groups + g]);
      for (int r = 0; r < kRows; ++r) {
        const float* xg = x + r * k + g * kGroup;
        Vec dot = vmul(w[0], vload(xg));
        for (int part = 1; part < kParts; ++part) dot = vfma(w[part], vload(xg + part * kLanes), dot);
        acc[c][r] = vfma(dot, scale, acc[c][r]);
      }
    }
  }
  for (int c = 0; c < kChannels; ++c)
    for (int r = 0; r < kRows; ++r) out[c * kRows + r] = vsum(acc[c][r]);
}
#else
template <int kChannels, int kRows>
void block(const float* x, int64_t k, const uint8_t* q, const float* s, float* out) {
  const int64_t groups = k / kGroup;
  for (int c = 0; c < kChannels; ++c)
    for (int r = 0; r < kRows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < 16; ++b) {
          const uint8_t byte = q[c * k / 2 + g * 16 + b];
          const float scale = s[c * groups + g];
          total += float(byte & 15) * scale * x[r * k + g * kGroup + b];
          total += float(byte >> 4) * scale * x[r * k + g * kGroup + b + 16];
        }
      out[c * kRows + r] = total;
    }
}
#endif

template <int kChannels>
void rows_block(const float* x, int64_t rows, int64_t k, const uint8_t* q, const float* s,
                float* out) {
  switch (rows) {
    case 1: return block<kChannels, 1>(x, k, q, s, out);
    case 2: return block<kChannels, 2>(x, k, q, s, out);
    case 3: return block<kChannels, 3>(x, k, q, s, out);
    default: return block<kChannels, 4>(x, k, q, s, out);
  }
}

// 5 to 8 rows share one decode of a channel's codes (8 accumulators: registers allow one
// channel at a time); the sums run in the order of the 1-4-row blocks.
void many_rows_block(const float* x, int64_t rows, int64_t k, const uint8_t* q, const float* s,
                     float* out) {
  switch (rows) {
    case 5: return block<1, 5>(x, k, q, s, out);
    case 6: return block<1, 6>(x, k, q, s, out);
    case 7: return block<1, 7>(x, k, q, s, out);
    default: return block<1, 8>(x, k, q, s, out);
  }
}

struct Problem {
  const float* x;
  int64_t rows;
  const uint8_t* q;
  const float* s;
  const float* o;
  float* y;
  int64_t n, k;
  const float* group_sums;  // [rows][k / 32]: Σx per group
};

// Output channels [first, first + count), count <= 2, for rows [row, row + count_rows).
void channels(const Problem& p, int64_t first, int count, int64_t row, int64_t count_rows) {
  const int64_t groups = p.k / kGroup;
  const float* x = p.x + row * p.k;
  const uint8_t* q = p.q + first * p.k / 2;
  const float* s = p.s + first * groups;
  float out[2 * kRowBlock];
  if (count_rows > 4) {
    for (int c = 0; c < count; ++c)
      many_rows_block(x, count_rows, p.k, q + c * p.k / 2, s + c * groups, out + c * count_rows);
  } else if (count == 2) {
    rows_block<2>(x, count_rows, p.k, q, s, out);
  } else {
    rows_block<1>(x, count_rows, p.k, q, s, out);
  }
  for (int c = 0; c < count; ++c) {
    const float* offsets = p.o + (first + c) * groups;
    for (int64_t r = 0; r < count_rows; ++r) {
      const float* sums = p.group_sums + (row + r) * groups;
      p.y[(row + r) * p.n + first + c] = out[c * count_rows + r] + dot(offsets, sums, groups);
    }
  }
}

void matmul(const Problem& p, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t start = 0; start < p.n; start += kChunk) {
    const int64_t end = std::min(p.n, start + kChunk);
    prefetch_channels(p.q, p.s, p.o, p.k, end, std::min(p.n, end + kChunk));
    for (int64_t row = 0; row < p.rows; row += kRowBlock)
      for (int64_t j = start; j < end; j += 2)
        channels(p, j, int(std::min<int64_t>(2, end - j)), row,
                 std::min<int64_t>(kRowBlock, p.rows - row));
  }
}

}  // namespace

// y [rows, n] = x [rows, k] times the 4-bit weight transposed: codes q [n, k / 2] as above,
// scales s and offsets o [n, k / 32], all fp32. 1 when the arguments are out of range.
extern "C" int loom_int4_matmul(const float* x, int64_t rows, const uint8_t* q, const float* s,
                                const float* o, float* y, int64_t n, int64_t k, int threads) {
  if (rows < 1 || k % kGroup) return 1;
  const int64_t groups = k / kGroup;
  // Σx per group and row, in one order: the offsets' share of every output, Σ_g o_g · Σx_g.
  std::vector<float> group_sums(rows * groups, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < kGroup; ++i) group_sums[r * groups + g] += x[r * k + g * kGroup + i];
  matmul({x, rows, q, s, o, y, n, k, group_sums.data()}, threads);
  return 0;
}
