// y = x Wᵀ for a 4-bit weight (W = q·s + o per group of 32 input channels, q in 0..15, codes
// packed as in int4_matmul.cpp) times activations quantized to 8 bits per group of 32 on the
// fly: x ≈ a·d, d = max|x| / 127 of the group, a = round-half-even(x / d) in -127..127 (codes 0
// and d = 0 for a group of zeros). This is llama.cpp's Q4_1 × Q8_1 product: a group's 32
// products are exact integers (AVX2 `maddubs`: unsigned codes times signed bytes, pairs summed
// in 16 bits without overflow, 15·127·2 < 2¹⁵), so the arithmetic per weight is a third of
// the fp32 kernel's, and the result is float math on the fake-quantized activations, up to
// the order of the float sums:
//   y = Σ_g s_g·d_g·Σ_{i∈g} q_i·a_i + Σ_g o_g·(d_g·Σ_{i∈g} a_i).
// A row's sums run in one fixed order whatever the other rows, their number and the threads.
#include "weight_stream.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 16;  // output channels per OpenMP task
constexpr int kMaxRows = 8;     // rows sharing one pass over the codes

// A row of x quantized: codes a, and per group d and d·Σa (the fake-quantized group's sum).
struct Activations {
  std::vector<int8_t> codes;     // [rows][k]
  std::vector<float> scales;     // [rows][groups]
  std::vector<float> sums;       // [rows][groups]
};

void quantize_group(const float* x, int8_t* a, float* scale, float* sum) {
  float amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  int total = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    const int code = d > 0.f ? int(std::nearbyint(x[i] / d)) : 0;
    a[i] = int8_t(code);
    total += code;
  }
  *scale = d;
  *sum = d * float(total);
}

#if defined(__AVX2__)
// The same codes as quantize_group (a division and round-half-even per lane).
void quantize_group_avx2(const float* x, int8_t* a, float* scale, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int part = 0; part < 4; ++part) {
    v[part] = _mm256_loadu_ps(x + 8 * part);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[part]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f;
  *scale = d;
  if (!(d > 0.f)) {
    std::fill(a, a + kGroup, int8_t(0));
    *sum = 0.f;
    return;
  }
  const __m256 divisor = _mm256_set1_ps(d);
  __m256i codes[4];
  for (int part = 0; part < 4; ++part)
    codes[part] = _mm256_cvtps_epi32(_mm256_round_ps(
        _mm256_div_ps(v[part], divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]),
                                         _mm256_add_epi32(codes[2], codes[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
  s = _mm_hadd_epi32(s, s);
  s = _mm_hadd_epi32(s, s);
  *sum = d * float(_mm_cvtsi128_si32(s));
  // 32-bit lanes to bytes: packs work within 128-bit halves, so put the lanes back in order.
  const __m256i words = _mm256_packs_epi32(codes[0], codes[1]);
  const __m256i words_hi = _mm256_packs_epi32(codes[2], codes[3]);
  const __m256i bytes = _mm256_packs_epi16(words, words_hi);
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), ordered);
}
#endif

Activations quantize(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  Activations acts{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
                   std::vector<float>(rows * groups)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * groups + g;
#if defined(__AVX2__)
      quantize_group_avx2(x + r * k + g * kGroup, acts.codes.data() + r * k + g * kGroup,
                          &acts.scales[at], &acts.sums[at]);
#else
      quantize_group(x + r * k + g * kGroup, acts.codes.data() + r * k + g * kGroup,
                     &acts.scales[at], &acts.sums[at]);
#endif
    }
  return acts;
}

struct Problem {
  const Activations& acts;
  int64_t rows;
  const uint8_t* q;
  const float* s;
  const float* o;
  float* y;
  int64_t n, k;
  int64_t groups() const { return k / kGroup; }
};

#if defined(__AVX2__)
// Σ_g s_g·d_g·Σ q·a for kChannels channels and kRows rows from `row`: out[c * kRows + r].
template <int kChannels, int kRows>
void block(const Problem& p, int64_t channel, int64_t row, float* out) {
  const int64_t groups = p.groups();
  const __m128i low_nibbles = _mm_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kChannels][kRows];
  for (int c = 0; c < kChannels; ++c)
    for (int r = 0; r < kRows; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i a[kRows];
    float d[kRows];
    for (int r = 0; r < kRows; ++r) {
      a[r] = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(p.acts.codes.data() + (row + r) * p.k + g * kGroup));
      d[r] = p.acts.scales[(row + r) * groups + g];
    }
    for (int c = 0; c < kChannels; ++c) {
      const __m128i packed = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(p.q + (channel + c) * p.k / 2 + g * 16));
      // Bytes 0-15: codes 0-15 (low nibbles); bytes 16-31: codes 16-31 (high).
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles),
                                         _mm_and_si128(packed, low_nibbles));
      const float s = p.s[(channel + c) * groups + g];
      for (int r = 0; r < kRows; ++r) {
        const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a[r]), ones);
        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pairs), _mm256_set1_ps(s * d[r]),
                                    acc[c][r]);
      }
    }
  }
  for (int c = 0; c < kChannels; ++c)
    for (int r = 0; r < kRows; ++r) out[c * kRows + r] = sum8(acc[c][r]);
}
#else
template <int kChannels, int kRows>
void block(const Problem& p, int64_t channel, int64_t row, float* out) {
  const int64_t groups = p.groups();
  for (int c = 0; c < kChannels; ++c)
    for (int r = 0; r < kRows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* codes = p.q + (channel + c) * p.k / 2 + g * 16;
        const int8_t* a = p.acts.codes.data() + (row + r) * p.k + g * kGroup;
        int dot = 0;
        for (int64_t b = 0; b < 16; ++b) dot += (codes[b] & 15) * a[b] + (codes[b] >> 4) * a[b + 16];
        total += float(dot) * (p.s[(channel + c) * groups + g] *
                               p.acts.scales[(row + r) * groups + g]);
      }
      out[c * kRows + r] = total;
    }
}
#endif

// Channels [channel, channel + kChannels) for rows [row, row + kRows), offsets' term added.
template <int kChannels, int kRows>
void channels(const Problem& p, int64_t channel, int64_t row) {
  float out[kChannels * kRows];
  block<kChannels, kRows>(p, channel, row, out);
  const int64_t groups = p.groups();
  for (int c = 0; c < kChannels; ++c)
    for (int r = 0; r < kRows; ++r)
      p.y[(row + r) * p.n + channel + c] =
          out[c * kRows + r] + dot(p.o + (channel + c) * groups,
                                   p.acts.sums.data() + (row + r) * groups, groups);
}

// Fewer rows, more channels at once: enough independent sums to hide the latencies, few
// enough to keep every sum in a register.
template <int kRows>
void channel_range(const Problem& p, int64_t start, int64_t end, int64_t row) {
  constexpr int kWide = kRows <= 2 ? 4 : kRows <= 4 ? 2 : 1;
  int64_t j = start;
  for (; j + kWide <= end; j += kWide) channels<kWide, kRows>(p, j, row);
  for (; j < end; ++j) channels<1, kRows>(p, j, row);
}

void matmul(const Problem& p, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t start = 0; start < p.n; start += kChunk) {
    const int64_t end = std::min(p.n, start + kChunk);
    prefetch_channels(p.q, p.s, p.o, p.k, end, std::min(p.n, end + kChunk));
    for (int64_t row = 0; row < p.rows; row += kMaxRows) {
      switch (std::min<int64_t>(kMaxRows, p.rows - row)) {
        case 1: channel_range<1>(p, start, end, row); break;
        case 2: channel_range<2>(p, start, end, row); break;
        case 3: channel_range<3>(p, start, end, row); break;
        case 4: channel_range<4>(p, start, end, row); break;
        case 5: channel_range<5>(p, start, end, row); break;
        case 6: channel_range<6>(p, start, end, row); break;
        case 7: channel_range<7>(p, start, end, row); break;
        default: channel_range<8>(p, start, end, row); break;
      }
    }
  }
}

}  // namespace

// y [rows, n] = x [rows, k] (fp32, quantized here per group of 32) times the 4-bit weight
// transposed: codes q [n, k / 2], scales s and offsets o [n, k / 32], fp32. 1 when the
// arguments are out of range.
extern "C" int loom_w4a8_matmul(const float* x, int64_t rows, const uint8_t* q, const float* s,
                                const float* o, float* y, int64_t n, int64_t k, int threads) {
  if (rows < 1 || k % kGroup) return 1;
  const Activations acts = quantize(x, rows, k);
  matmul({acts, rows, q, s, o, y, n, k}, threads);
  return 0;
}

// The activation codes and scales the product uses: a [rows, k] int8, d [rows, k / 32].
extern "C" int loom_w4a8_quantize(const float* x, int64_t rows, int64_t k, int8_t* a,
                                  float* d) {
  if (rows < 1 || k % kGroup) return 1;
  const Activations acts = quantize(x, rows, k);
  std::copy(acts.codes.begin(), acts.codes.end(), a);
  std::copy(acts.scales.begin(), acts.scales.end(), d);
  return 0;
}
