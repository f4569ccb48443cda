// Routed experts' 4-bit weights times their tokens, every expert in one call: rows of x come
// grouped by expert (counts[e] rows for expert e, in the experts' order) and each expert's weight is
// W = (q - 8)·s + z per group of 32 input channels (the int4 layer's codes, q in 0..15), s and
// z in bf16. Activations and outputs are bf16; products and sums run on `vdpbf16ps`.
//
// A code becomes a bf16 with bit operations alone: 0x4300 | q is 128 + q exactly, so
// Σ_k W·x = Σ_g s_g·Σ_k∈g (128 + q)·x + (z_g - 136·s_g)·Σ_k∈g x. Each product of the dot is
// exact in fp32; x's per-group sums are taken once per row.
//
// Output channels lie across the lanes, 16 to a tile; two adjacent input channels per lane
// (the instruction's pairs). The weight is laid out in blocks of 320 bytes, one per (expert,
// tile, group) in that order: 8 chunks of 32 bytes of codes, chunk c covering input channels
// 4c .. 4c + 3 of the group (byte i holds channel i / 2 of the tile at input 4c + i % 2 in
// its low nibble and at 4c + 2 + i % 2 in its high one), then the tile's 16 scales and 16
// zeros. One stream a tile: with the scales apart, one row ran 4-9% slower on a Zen 4 VM.
//
// A row's sums run in one order whatever shares the call (no split over k, each row's
// accumulators its own): a row's bits never depend on the other rows.
#include "bf16_vectors.h"
#include "numerics.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(LOOM_BF16_VECTORS)
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;                // output channels per tile
constexpr int64_t kCodeBytes = 256;          // one tile's codes of one group
constexpr int64_t kBlockBytes = kCodeBytes + 2 * kTile * 2;  // and its scales and zeros
constexpr int64_t kPrefetchGroups = 4;

struct Problem {
  const uint16_t* x;         // [rows, k] bf16
  const float* group_sums;   // [rows, k / 32]
  const uint8_t* blocks;     // [experts, n / 16, k / 32, 320]
  uint16_t* y;               // [rows, n] bf16
  int64_t n, k;
  int64_t groups() const { return k / kGroup; }
  int64_t tiles() const { return n / kTile; }
  const uint8_t* block_at(int64_t expert, int64_t tile, int64_t group) const {
    return blocks + ((expert * tiles() + tile) * groups() + group) * kBlockBytes;
  }
  const uint16_t* scales(int64_t expert, int64_t tile, int64_t group) const {
    return reinterpret_cast<const uint16_t*>(block_at(expert, tile, group) + kCodeBytes);
  }
};

inline __m512bh pair(const uint16_t* x, int64_t index) {  // x[2i], x[2i + 1] in every lane
  return (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(x)[index]);
}

// One group's dot products for tiles [tile, tile + T) and rows [row, row + R): out[t][r], the
// 16 sums Σ_k∈g (128 + q)·x of tile t's channels for row r.
template <int T, int R>
void group_dots(const Problem& p, int64_t expert, int64_t tile, int64_t row, int64_t g,
                __m512* out) {
  const __m512i low_nibble = _mm512_set1_epi16(0x0F), exponent = _mm512_set1_epi16(0x4300);
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  // Codes kPrefetchGroups groups ahead; near a span's end, the next span's first groups
  // (prefetching past the array's end is harmless: it never faults), into L2: one row 15% faster
  // than into L1 on a Zen 4 VM, whose few L1 miss buffers the prefetches otherwise hold.
  const int64_t ahead = g + kPrefetchGroups + (g + kPrefetchGroups >= p.groups()) * (T - 1) *
                                                  p.groups();
  for (int t = 0; t < T; ++t) {
    const char* line = reinterpret_cast<const char*>(p.block_at(expert, tile + t, ahead));
    for (int offset = 0; offset < kBlockBytes; offset += 64) _mm_prefetch(line + offset, _MM_HINT_T1);
  }
  for (int c = 0; c < 8; ++c) {
    __m512bh low[T], high[T];  // every tile's codes first, then each row's pair once
    for (int t = 0; t < T; ++t) {
      const uint8_t* chunk = p.block_at(expert, tile + t, g) + c * 32;
      const __m512i bytes =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
      low[t] = (__m512bh)_mm512_ternarylogic_epi32(bytes, low_nibble, exponent, 0xEA);
      high[t] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent);
    }
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = p.x + (row + r) * p.k + g * kGroup;
      const __m512bh even = pair(xr, 2 * c), odd = pair(xr, 2 * c + 1);
      for (int t = 0; t < T; ++t) {
        acc[t][r] = _mm512_dpbf16_ps(acc[t][r], low[t], even);
        acc[t][r] = _mm512_dpbf16_ps(acc[t][r], high[t], odd);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) _mm512_store_ps(reinterpret_cast<float*>(out + t * R + r), acc[t][r]);
}

// Tiles [tile, tile + T) of one expert for rows [row, row + R): y's 16·T channels. The
// groups' dot products go through memory a few groups at a time, so that the registers hold
// T·R sums while they run and T·R totals while the scales apply.
template <int T, int R>
void block(const Problem& p, int64_t expert, int64_t tile, int64_t row) {
  constexpr int64_t kGroupsPerPass = 8;
  const int64_t groups = p.groups();
  __m512 total[T][R], dots[kGroupsPerPass][T * R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) total[t][r] = _mm512_setzero_ps();
  for (int64_t first = 0; first < groups; first += kGroupsPerPass) {
    const int64_t count = std::min(kGroupsPerPass, groups - first);
    for (int64_t i = 0; i < count; ++i) group_dots<T, R>(p, expert, tile, row, first + i, dots[i]);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t g = first + i;
      for (int t = 0; t < T; ++t) {
        const uint16_t* sz = p.scales(expert, tile + t, g);
        const __m512 scale = load_bf16(sz), zero = load_bf16(sz + kTile);
        const __m512 offset = _mm512_fnmadd_ps(scale, _mm512_set1_ps(136.f), zero);
        for (int r = 0; r < R; ++r) {
          const __m512 sum = _mm512_set1_ps(p.group_sums[(row + r) * groups + g]);
          total[t][r] = _mm512_fmadd_ps(dots[i][t * R + r], scale, total[t][r]);
          total[t][r] = _mm512_fmadd_ps(sum, offset, total[t][r]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y + (row + r) * p.n + (tile + t) * kTile),
                          to_bf16(total[t][r]));
}

// Tiles taken at once: enough independent sums to hide vdpbf16ps's latency with few rows,
// at most 16 sums (registers) with many.
inline int64_t tiles_at_once(int64_t rows) { return rows == 1 ? 8 : rows <= 4 ? 4 : 2; }

template <int T, int R>
void block_if_fits(const Problem& p, int64_t expert, int64_t tile, int64_t row) {
  if constexpr (T == 1 || T * R <= 16) block<T, R>(p, expert, tile, row);
}

template <int T>
void span(const Problem& p, int64_t expert, int64_t tile, int64_t row, int64_t rows) {
  switch (rows) {
    case 1: return block_if_fits<T, 1>(p, expert, tile, row);
    case 2: return block_if_fits<T, 2>(p, expert, tile, row);
    case 3: return block_if_fits<T, 3>(p, expert, tile, row);
    case 4: return block_if_fits<T, 4>(p, expert, tile, row);
    case 5: return block_if_fits<T, 5>(p, expert, tile, row);
    case 6: return block_if_fits<T, 6>(p, expert, tile, row);
    case 7: return block_if_fits<T, 7>(p, expert, tile, row);
    default: return block_if_fits<T, 8>(p, expert, tile, row);
  }
}

// Tiles [first, last) of one expert for its rows [begin, end), 8 rows at a time.
void task(const Problem& p, int64_t expert, int64_t first, int64_t last, int64_t begin,
          int64_t end) {
  const int64_t blocks = (end - begin + 7) / 8;  // as even as can be: 10 rows are 5 + 5
  for (int64_t b = 0, row = begin; b < blocks; ++b) {
    const int64_t rows = (end - row) / (blocks - b);
    const int64_t next = row + rows;
    const int64_t width = tiles_at_once(rows);
    int64_t tile = first;
    for (; tile + width <= last; tile += width) {
      switch (width) {
        case 8: span<8>(p, expert, tile, row, rows); break;
        case 4: span<4>(p, expert, tile, row, rows); break;
        case 2: span<2>(p, expert, tile, row, rows); break;
        default: span<1>(p, expert, tile, row, rows);
      }
    }
    for (; tile < last; ++tile) span<1>(p, expert, tile, row, rows);
    row = next;
  }
}

}  // namespace

extern "C" int loom_moe_int4_available() { return 1; }

// y [rows, n] = for each expert e, its counts[e] rows of x (after those of experts 0 .. e - 1)
// times its weight transposed (see the top); no counts: one expert, every row its. 1 when the
// shapes are out of range.
extern "C" int loom_moe_int4(const uint16_t* x, int64_t rows, const int64_t* counts,
                             int64_t experts, const uint8_t* blocks, uint16_t* y, int64_t n,
                             int64_t k, int threads) {
  if (rows < 0 || k % kGroup || n % kTile || (!counts && experts != 1)) return 1;
  if (!counts) counts = &rows;
  std::vector<int64_t> start(experts + 1, 0);
  int64_t active = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] < 0) return 1;
    start[e + 1] = start[e] + counts[e];
    active += counts[e] > 0;
  }
  if (start[experts] != rows) return 1;
  const int64_t groups = k / kGroup;
  std::vector<float> group_sums(rows * groups);
  for (int64_t i = 0; i < rows * groups; ++i)  // each in one order: a vector's lanes, folded
    group_sums[i] = _mm512_reduce_add_ps(
        _mm512_add_ps(load_bf16(x + i * kGroup), load_bf16(x + i * kGroup + kTile)));
  const Problem p{x, group_sums.data(), blocks, y, n, k};
  // Long tasks (fewer cold starts of the codes' streams), yet several per thread.
  const int64_t per_task = std::clamp<int64_t>(p.tiles() * active / (4 * threads), 8, 32);
  struct Task { int64_t expert, first, last; };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] == 0) continue;
    for (int64_t first = 0; first < p.tiles(); first += per_task)
      tasks.push_back({e, first, std::min(p.tiles(), first + per_task)});
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic)
  for (size_t i = 0; i < tasks.size(); ++i)
    task(p, tasks[i].expert, tasks[i].first, tasks[i].last, start[tasks[i].expert],
         start[tasks[i].expert + 1]);
  return 0;
}
#else
extern "C" int loom_moe_int4_available() { return 0; }
extern "C" int loom_moe_int4(const uint16_t*, int64_t, const int64_t*, int64_t, const uint8_t*,
                             uint16_t*, int64_t, int64_t, int) {
  return 2;
}
#endif

// The kernel's rows in and out. Routing's (token, slot) pairs, experts [tokens, k], grouped by
// expert with tokens in order within one (a stable sort): counts [E] of each expert, rows
// [tokens, k] (each pair's row in that order) and x's rows gathered there, grouped
// [tokens * k, hidden] (bf16). 1 when an expert is out of range.
extern "C" int loom_moe_group(const int64_t* experts, int64_t tokens, int64_t k,
                              int64_t num_experts, const uint16_t* x, int64_t hidden,
                              int64_t* counts, int64_t* rows, uint16_t* grouped) {
  std::fill(counts, counts + num_experts, 0);
  for (int64_t i = 0; i < tokens * k; ++i) {
    if (experts[i] < 0 || experts[i] >= num_experts) return 1;
    ++counts[experts[i]];
  }
  std::vector<int64_t> next(num_experts, 0);
  for (int64_t e = 1; e < num_experts; ++e) next[e] = next[e - 1] + counts[e - 1];
  for (int64_t i = 0; i < tokens * k; ++i) {
    rows[i] = next[experts[i]]++;
    std::memcpy(grouped + rows[i] * hidden, x + (i / k) * hidden, hidden * sizeof(uint16_t));
  }
  return 0;
}

// y [tokens, hidden] = Σ_j weights[t, j] · out[rows[t, j]] (out [tokens * k, hidden], bf16),
// summed in fp32 in the order of the rows (the experts' order) and rounded once: a token's
// sum depends on its own pairs alone.
extern "C" void loom_moe_combine(const uint16_t* out, const int64_t* rows, const float* weights,
                                 int64_t tokens, int64_t k, int64_t hidden, uint16_t* y,
                                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int64_t> order(k);
    for (int64_t j = 0; j < k; ++j) order[j] = j;
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return rows[t * k + a] < rows[t * k + b]; });
    std::vector<float> sum(hidden, 0.f);
    for (const int64_t j : order) {
      const uint16_t* source = out + rows[t * k + j] * hidden;
      const float weight = weights[t * k + j];
      for (int64_t h = 0; h < hidden; ++h) sum[h] += weight * to_float(source[h]);
    }
    for (int64_t h = 0; h < hidden; ++h) store(y + t * hidden + h, sum[h]);
  }
}
