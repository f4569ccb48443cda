// Plain C++ (no torch headers: it compiles in seconds). One OpenMP task per (request, kv
// head), or per request when there are enough requests, reads its blocks straight from the
// paged cache (the vector paths fetching the block two ahead a line at a time as they read,
// the plain loops and AMX tiles a block or a head at a time), and keeps scores, softmax and
// accumulators in fp32. Where the CPU has AVX-512, head_dim 64 and 128 with up to 8 query
// heads per KV head (blocks a multiple of 16 tokens) take a path that scores 16 tokens at a
// time and keeps the output sums in registers; with AMX, bf16 caches of 64 tokens and more
// take tile products (DecodeTiles); elsewhere the compiler vectorizes the plain loops (or
// AVX2 where the CPU has it). An 8-bit cache (int8 or fp8 codes, each row's fp32 scale after
// its codes: engine/attention/quantized_kv.py) takes AVX-512 or AVX2 the same way, its codes
// widened to fp32 as they are read and a row's scale applied to its score and its weight;
// int8 keys under bf16 queries are multiplied as integers where the CPU has AVX512-VNNI
// (int8_vnni.h).
#include "amx.h"
#include "avx2.h"
#include "avx512.h"
#include "int8_vnni.h"
#include "numerics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// int8 rows under bf16 queries go through int8_vnni.h's integer products where the CPU has
// them (their 15-bit query carries ~1e-4 of its largest value, far below bf16's own
// rounding); fp32 queries keep fp32 products.
template <typename T, typename C>
#if defined(LOOM_INT8_VNNI)
constexpr bool kInt8Products = std::is_same_v<C, int8_t> && std::is_same_v<T, uint16_t>;
#else
constexpr bool kInt8Products = false;
#endif

inline void prefetch(const void* ptr, int64_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

inline void prefetch_l2(const void* ptr, int64_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// A task asks for this many bytes of its K and V into L2 at its start (a short context's
// all), then one block more of each per block it reads (BlockPrefetch; measured in
// docs/benchmarks.md, "Decode attention: an L2 prefetch window").
constexpr int64_t kPrefetchL2Bytes = 128 << 10;
constexpr int64_t kPrefetchAhead = 4;  // blocks into L1

inline int64_t l2_window(int64_t span) {  // blocks of K (and as many of V) in the window
  return std::max<int64_t>(1, kPrefetchL2Bytes / (2 * span));
}

inline bool scattered(const int64_t* table, int64_t b) {
  return b == 0 || table[b] != table[b - 1] + 1;
}

// The vector paths (AVX-512, AVX2) fetch the rows kRowsAheadBlocks blocks ahead of their walk
// as they read, each line once: reading row i of 16 fetches the i-th sixteenth of the lines of
// the 16 rows at the same place that far ahead. Spread so, the misses overlap; a block's (or
// a head's) lines asked for at once fill the core's miss buffers and stall it, and so does a
// line asked for again while its miss is outstanding. The lines go to L2 (prefetcht1): into
// L1 they hold the core's few L1 miss buffers and the walk ran 1.4-1.5x slower on a Zen 4 VM.
// docs/benchmarks.md, "Decode attention: prefetching a line at a time" and "Prefetching into
// L2".
constexpr int64_t kRowsAheadBlocks = 2;

// Where a task's blocks are fetched ahead of its walk (over K, then over V): at its start
// the first `window` blocks of K and V into L2 (a block stored right after its predecessor
// left to the hardware), and the first few of the cache walked into L1; then, per block b
// read, block b + kPrefetchAhead into L1 and block b + window into L2. The vector paths take
// only the first few blocks so, and `rows_ahead` as they read.
template <typename C, typename BlockPtr>
struct BlockPrefetch {
  const int64_t* table;
  int64_t num_blocks, span, window;
  BlockPtr block_ptr;  // (cache, block index) -> the task's stretch of that block

  void l2_window_of(const C* k_cache, const C* v_cache) const {
    for (int64_t b = 0; b < std::min(window, num_blocks); ++b) {
      if (scattered(table, b)) {
        prefetch_l2(block_ptr(k_cache, b), span);
        prefetch_l2(block_ptr(v_cache, b), span);
      }
    }
  }

  void first_of(const C* cache) const {
    for (int64_t b = 0; b < std::min(kPrefetchAhead, num_blocks); ++b)
      prefetch(block_ptr(cache, b), span);
  }

  void past(const C* cache, int64_t b) const {
    if (b + kPrefetchAhead < num_blocks) prefetch(block_ptr(cache, b + kPrefetchAhead), span);
    if (b + window < num_blocks && scattered(table, b + window))
      prefetch_l2(block_ptr(cache, b + window), span);
  }

  // Block b + kRowsAheadBlocks's stretch, `offset` elements in, as bytes for
  // prefetch_sixteenth (nullptr past the walk's end).
  const char* rows_ahead(const C* cache, int64_t b, int64_t offset = 0) const {
    if (b + kRowsAheadBlocks >= num_blocks) return nullptr;
    return reinterpret_cast<const char*>(block_ptr(cache, b + kRowsAheadBlocks) + offset);
  }
};

template <typename C, typename BlockPtr>
BlockPrefetch<C, BlockPtr> block_prefetch(const int64_t* table, int64_t num_blocks,
                                          int64_t span, BlockPtr block_ptr) {
  return {table, num_blocks, span, l2_window(span), block_ptr};
}

// The i-th sixteenth of the lines of the 16 rows at `rows16` (64-byte aligned; nullptr: none).
template <int64_t kRowBytes>
inline void prefetch_sixteenth(const char* rows16, int64_t i) {
  if (rows16 == nullptr) return;
  constexpr int64_t kLines = (16 * kRowBytes + 63) / 64;
  for (int64_t line = i * kLines / 16; line < (i + 1) * kLines / 16; ++line)
    __builtin_prefetch(rows16 + 64 * line, 0, 2);
}

// As prefetch_sixteenth, for row t of a walk over rows whose 16-row groups are 64-byte aligned.
template <int64_t kRowBytes>
inline void prefetch_for_row(const char* rows, int64_t t) {
  if (rows != nullptr) prefetch_sixteenth<kRowBytes>(rows + (t & ~int64_t(15)) * kRowBytes, t & 15);
}

// Row `index` of the rows at `rows` (nullptr stays nullptr).
inline const char* row_at(const char* rows, int64_t index, int64_t row_bytes) {
  return rows == nullptr ? nullptr : rows + index * row_bytes;
}

// Each of `group` rows of `len` scores becomes exp(score - its max); inv_sums gets 1 / row sum.
inline void softmax_rows(float* scores, int64_t group, int64_t len, const float* maxes,
                         float* inv_sums) {
  for (int64_t g = 0; g < group; ++g) {
    float total = 0.f;
    float* sg = scores + g * len;
    const float m = maxes[g];
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < len; ++j) {
      sg[j] = fast_exp(sg[j] - m);
      total += sg[j];
    }
    inv_sums[g] = 1.f / total;
  }
}

constexpr int kMaxGroup = 16;
constexpr int64_t kRequestsPerThread = 4;  // from this many on, one task per request
constexpr int kMaxDim = 256;

// One request's first `num_task_heads` KV heads from `head` on, attending its context's
// tokens [first, seq_len) (first > 0: a sliding window); softcap > 0: every scaled score s
// becomes softcap * tanh(s / softcap) (Gemma 2).
struct Task {
  int64_t seq_len, head, num_task_heads, group, num_kv_heads, block_size;
  float scale;
  int64_t first;
  float softcap;
  bool tiles;  // AMX may be used, where the CPU has it
};

// The blocks a task walks: from the one holding `first` (positions count from its start;
// those before head_start are outside the window) to its context's end.
struct Walk {
  int64_t skipped, len, head_start, num_blocks;

  explicit Walk(const Task& a)
      : skipped(a.first / a.block_size * a.block_size),
        len(a.seq_len - skipped),
        head_start(a.first - skipped),
        num_blocks((len + a.block_size - 1) / a.block_size) {}
};

// The task head's `group` query rows times the scale, as fp32 rows `stride` floats apart.
template <typename T>
inline void scaled_query(const T* q, const Task& a, int64_t group, int64_t dim, float* query,
                         int64_t stride) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d)
      query[g * stride + d] = to_float(q[(a.head * group + g) * dim + d]) * a.scale;
}

inline float capped(float s, float softcap) {
  return softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
}

// A cache row: head_dim values of the model's dtype, or head_dim 8-bit codes and their fp32
// scale (value = code's value * scale): int8 codes, or fp8 ones (e4m3fn, e5m2; the quantizer
// never writes their NaN or infinity codes).
constexpr int64_t kScaleBytes = 4;
enum class E4m3 : uint8_t {};
enum class E5m2 : uint8_t {};
template <typename C>
constexpr bool kCoded =
    std::is_same_v<C, int8_t> || std::is_same_v<C, E4m3> || std::is_same_v<C, E5m2>;

// An fp8 code's value: sign, exponent and mantissa fields, subnormals where the exponent is 0.
template <int kExponentBits>
inline float fp8_value(uint8_t code) {
  constexpr int kMantissaBits = 7 - kExponentBits, kBias = (1 << (kExponentBits - 1)) - 1;
  const uint32_t exponent = (code >> kMantissaBits) & ((1 << kExponentBits) - 1);
  const uint32_t mantissa = code & ((1 << kMantissaBits) - 1);
  float magnitude;
  if (exponent == 0) {
    magnitude = float(mantissa) / float(1 << (kBias + kMantissaBits - 1));
  } else {
    const uint32_t bits = (exponent + 127 - kBias) << 23 | mantissa << (23 - kMantissaBits);
    std::memcpy(&magnitude, &bits, sizeof magnitude);
  }
  return code & 0x80 ? -magnitude : magnitude;
}

inline float code_value(int8_t code) { return float(code); }
inline float code_value(E4m3 code) { return fp8_value<4>(uint8_t(code)); }
inline float code_value(E5m2 code) { return fp8_value<5>(uint8_t(code)); }

template <typename C>
constexpr int64_t row_width(int64_t dim) {
  return kCoded<C> ? dim + kScaleBytes : dim;
}

// `count` rows of a block as fp32 [count][dim].
template <typename C>
inline void rows_to_float(const C* rows, int64_t count, int64_t dim, float* out) {
  if constexpr (kCoded<C>) {
    for (int64_t t = 0; t < count; ++t) {
      const C* row = rows + t * (dim + kScaleBytes);
      float scale;
      std::memcpy(&scale, row + dim, sizeof scale);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[t * dim + d] = code_value(row[d]) * scale;
    }
  } else {
    for (int64_t i = 0; i < count * dim; ++i) out[i] = to_float(rows[i]);
  }
}

// One (request, kv head): the scores of its `group` query heads over the context, softmax,
// then the weighted sum of values. kDim > 0 fixes head_dim at compile time; C is the cache's
// element (T, or int8_t for codes).
template <typename T, typename C, int kDim>
void decode_one_head(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                     int64_t dim_arg, const Task& a, T* out, std::vector<float>& scores,
                     std::vector<float>& tile) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  const int64_t bs = a.block_size, group = a.group;
  const int64_t block_elems = bs * row_width<C>(dim);
  const auto [skipped, len, head_start, num_blocks] = Walk(a);
  table += skipped / bs;
  alignas(64) float query[kMaxGroup][kMaxDim];
  scaled_query(q, a, group, dim, query[0], kMaxDim);
  scores.resize(group * len);
  tile.resize(bs * dim);
  float* kf = tile.data();
  auto block_ptr = [&](const C* cache, int64_t b) {
    return cache + (table[b] * a.num_kv_heads + a.head) * block_elems;
  };

  const int64_t span = block_elems * int64_t(sizeof(C));
  const auto ahead = block_prefetch<C>(table, num_blocks, span, block_ptr);
  ahead.l2_window_of(k_cache, v_cache);
  ahead.first_of(k_cache);
  float maxes[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) maxes[g] = -INFINITY;
  for (int64_t b = 0; b < num_blocks; ++b) {
    ahead.past(k_cache, b);
    const int64_t start = b * bs, count = std::min(bs, len - start);
    rows_to_float(block_ptr(k_cache, b), count, dim, kf);
    int64_t t = b == 0 ? head_start : 0;
    for (int64_t g = 0; g < group; ++g)  // outside the window: zero weight after softmax
      std::fill(scores.data() + g * len + start, scores.data() + g * len + start + t, -INFINITY);
    for (; t + 4 <= count; t += 4) {
      const float* k0 = kf + t * dim;
      for (int64_t g = 0; g < group; ++g) {
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        const float* qg = query[g];
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < dim; ++d) {
          s0 += qg[d] * k0[d];
          s1 += qg[d] * k0[dim + d];
          s2 += qg[d] * k0[2 * dim + d];
          s3 += qg[d] * k0[3 * dim + d];
        }
        float* sg = scores.data() + g * len + start + t;
        s0 = capped(s0, a.softcap), s1 = capped(s1, a.softcap);
        s2 = capped(s2, a.softcap), s3 = capped(s3, a.softcap);
        sg[0] = s0, sg[1] = s1, sg[2] = s2, sg[3] = s3;
        maxes[g] = std::max(maxes[g], std::max(std::max(s0, s1), std::max(s2, s3)));
      }
    }
    for (; t < count; ++t)
      for (int64_t g = 0; g < group; ++g) {
        float s = 0.f;
        const float* qg = query[g];
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qg[d] * kf[t * dim + d];
        s = capped(s, a.softcap);
        scores[g * len + start + t] = s;
        maxes[g] = std::max(maxes[g], s);
      }
  }

  ahead.first_of(v_cache);
  float inv_sums[kMaxGroup];
  softmax_rows(scores.data(), group, len, maxes, inv_sums);

  alignas(64) float acc[kMaxGroup][kMaxDim];
  for (int64_t g = 0; g < group; ++g) std::fill(acc[g], acc[g] + dim, 0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    ahead.past(v_cache, b);
    const int64_t start = b * bs, count = std::min(bs, len - start);
    rows_to_float(block_ptr(v_cache, b), count, dim, kf);
    for (int64_t g = 0; g < group; ++g) {
      const float* pg = scores.data() + g * len + start;
      float* ag = acc[g];
      for (int64_t t = 0; t < count; ++t) {
        const float p = pg[t];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] += p * kf[t * dim + d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d)
      store(out + (a.head * group + g) * dim + d, acc[g][d] * inv_sums[g]);
}

template <typename T, typename C, int kDim>
void decode_one(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                int64_t dim_arg, const Task& a, T* out, std::vector<float>& scores,
                std::vector<float>& tile) {
  for (int64_t h = a.head; h < a.head + a.num_task_heads; ++h) {
    Task one = a;
    one.head = h;
    one.num_task_heads = 1;
    decode_one_head<T, C, kDim>(q, k_cache, v_cache, table, dim_arg, one, out, scores, tile);
  }
}

// fp8 codes widened to the fp16 with the same sign, exponent and mantissa bits: exact for
// e5m2 (fp16's top byte); e4m3's smaller exponent bias leaves its fp16 kShortBy times too
// small, which row_scale makes up (a power of two: the products round as the values' would).
template <typename C>
constexpr float kShortBy = std::is_same_v<C, E4m3> ? 256.f : 1.f;
template <typename C>
inline float row_scale(const C* row, int64_t dim) {
  if constexpr (kCoded<C>) {
    float scale;
    std::memcpy(&scale, row + dim, sizeof scale);
    return scale * kShortBy<C>;
  } else {
    (void)row, (void)dim;
    return 1.f;
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2, head_dim and the group fixed at compile time, over rows of fp32, bf16 or 8-bit codes
// (their scale applied to each token's sums). Scores come four tokens at a time: each
// token's products with a query head as one vector of partial sums, four folded into the
// four scores with horizontal adds. Values are added kVecs vectors of dims at a time, every
// query head's sums in registers, each block's rows read once.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m128i load8_bytes(const void* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8_bytes(p)));
}
inline __m256 load8(const E5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load8_bytes(p)), 8));
}
inline __m256 load8(const E4m3* p) {  // sign-extended, so the fp16's bit 14 is cleared
  const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(load8_bytes(p)), 7);
  return _mm256_cvtph_ps(_mm_and_si128(shifted, _mm_set1_epi16(int16_t(0xbfff))));
}

// The four tokens' sums of their vectors of partial sums, in token order.
inline __m128 fold4(__m256 t0, __m256 t1, __m256 t2, __m256 t3) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// One token's products with the group's query heads as vectors of partial sums.
template <typename C, int kDim, int kGroup>
inline void token_partials(const C* row, const float (*query)[kDim], __m256* out) {
  constexpr int64_t kChunks = kDim / 8;
  __m256 keys[kChunks];
  for (int64_t c = 0; c < kChunks; ++c) keys[c] = load8(row + 8 * c);
  for (int64_t g = 0; g < kGroup; ++g) {  // two chains of FMAs, not one long one
    __m256 even = _mm256_mul_ps(keys[0], _mm256_load_ps(query[g]));
    __m256 odd = _mm256_mul_ps(keys[1], _mm256_load_ps(query[g] + 8));
    for (int64_t c = 2; c < kChunks; c += 2) {
      even = _mm256_fmadd_ps(keys[c], _mm256_load_ps(query[g] + 8 * c), even);
      odd = _mm256_fmadd_ps(keys[c + 1], _mm256_load_ps(query[g] + 8 * c + 8), odd);
    }
    out[g] = _mm256_add_ps(even, odd);
  }
}

template <typename T, typename C, int kDim, int kGroup>
void decode_head_avx2(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                      const Task& a, T* out, std::vector<float>& scores) {
  constexpr int64_t kWidth = row_width<C>(kDim);
  // Vectors of dims added per pass over a block's values: sums, values and weight in the
  // 16 registers (int8 rows widen into two more).
  constexpr int kVecs = kCoded<C> ? (kGroup <= 2 ? 4 : kGroup <= 6 ? 2 : 1)
                                  : (kGroup == 1 ? 8 : kGroup <= 3 ? 4 : kGroup <= 7 ? 2 : 1);
  const int64_t bs = a.block_size, block_elems = bs * kWidth;
  const auto [skipped, len, head_start, num_blocks] = Walk(a);
  table += skipped / bs;
  alignas(32) float query[kGroup][kDim];
  scaled_query(q, a, kGroup, kDim, query[0], kDim);
  scores.resize(kGroup * len);
  auto block_ptr = [&](const C* cache, int64_t b) {
    return cache + (table[b] * a.num_kv_heads + a.head) * block_elems;
  };
  constexpr int64_t kRowBytes = kWidth * sizeof(C);
  const auto fetch = block_prefetch<C>(table, num_blocks, block_elems * sizeof(C), block_ptr);
  fetch.first_of(k_cache);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs, count = std::min(bs, len - start);
    const C* rows = block_ptr(k_cache, b);
    const char* ahead = fetch.rows_ahead(k_cache, b);
    for (int64_t t = 0; t < count; t += 4) {
      __m256 partials[4][kGroup];
      alignas(16) float scales[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < 4 && t + i < count; ++i) {
        prefetch_for_row<kRowBytes>(ahead, t + i);
        const C* row = rows + (t + i) * kWidth;
        token_partials<C, kDim, kGroup>(row, query, partials[i]);
        scales[i] = row_scale(row, kDim);
      }
      for (int64_t i = count - t; i < 4; ++i)
        for (int64_t g = 0; g < kGroup; ++g) partials[i][g] = _mm256_setzero_ps();
      const __m128 scale4 = _mm_load_ps(scales);
      for (int64_t g = 0; g < kGroup; ++g) {
        const __m128 four = _mm_mul_ps(fold4(partials[0][g], partials[1][g], partials[2][g],
                                             partials[3][g]), scale4);
        alignas(16) float lanes[4];
        _mm_store_ps(lanes, four);
        std::copy(lanes, lanes + std::min<int64_t>(4, count - t), &scores[g * len + start + t]);
      }
    }
  }
  float maxes[kGroup];
  for (int64_t g = 0; g < kGroup; ++g) {
    float* sg = &scores[g * len];
    std::fill(sg, sg + head_start, -INFINITY);  // outside the window: zero weight
    if (a.softcap > 0.f)
      for (int64_t j = head_start; j < len; ++j) sg[j] = capped(sg[j], a.softcap);
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < len; ++j) top = std::max(top, sg[j]);
    maxes[g] = top;
  }
  fetch.first_of(v_cache);
  float inv_sums[kGroup];
  softmax_rows(scores.data(), kGroup, len, maxes, inv_sums);
  alignas(32) float acc[kGroup][kDim] = {};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs, count = std::min(bs, len - start);
    const C* rows = block_ptr(v_cache, b);
    const char* ahead = fetch.rows_ahead(v_cache, b);
    for (int64_t part = 0; part < kDim; part += 8 * kVecs) {
      __m256 sums[kGroup][kVecs];
      for (int64_t g = 0; g < kGroup; ++g)
        for (int64_t c = 0; c < kVecs; ++c) sums[g][c] = _mm256_load_ps(acc[g] + part + 8 * c);
      for (int64_t t = 0; t < count; ++t) {
        if (part == 0) prefetch_for_row<kRowBytes>(ahead, t);
        const C* row = rows + t * kWidth;
        __m256 values[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) values[c] = load8(row + part + 8 * c);
        const float scale = row_scale(row, kDim);
        for (int64_t g = 0; g < kGroup; ++g) {
          const __m256 weight = _mm256_set1_ps(scores[g * len + start + t] * scale);
          for (int64_t c = 0; c < kVecs; ++c)
            sums[g][c] = _mm256_fmadd_ps(weight, values[c], sums[g][c]);
        }
      }
      for (int64_t g = 0; g < kGroup; ++g)
        for (int64_t c = 0; c < kVecs; ++c) _mm256_store_ps(acc[g] + part + 8 * c, sums[g][c]);
    }
  }
  for (int64_t g = 0; g < kGroup; ++g)
    for (int64_t d = 0; d < kDim; ++d)
      store(out + (a.head * kGroup + g) * kDim + d, acc[g][d] * inv_sums[g]);
}

template <typename T, typename C, int kDim, int kGroup>
void decode_one_avx2(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                     int64_t, const Task& a, T* out, std::vector<float>& scores,
                     std::vector<float>&) {
  for (int64_t h = a.head; h < a.head + a.num_task_heads; ++h) {
    Task one = a;
    one.head = h;
    decode_head_avx2<T, C, kDim, kGroup>(q, k_cache, v_cache, table, one, out, scores);
  }
}
#endif

// Up to kMaxRun rows of one request at consecutive positions (a decode and its drafts, or a
// short prompt chunk's rows), row r seeing its context's first lens[r] tokens.
constexpr int kMaxRun = 16;

template <typename T>
struct Run {
  int64_t size;
  const T* q[kMaxRun];
  T* out[kMaxRun];
  int64_t lens[kMaxRun];
};

#if defined(__AVX512F__)
// AVX-512: head_dim 64 or 128 and the group fixed at compile time. Scores come 16 tokens at
// a time: each token's dot product as a vector of 16 partial sums (bf16 pairs through
// vdpbf16ps where the CPU has it, fp32 FMAs elsewhere), then 16 such vectors folded into one
// vector of the 16 scores, with no horizontal sum per token. Values are widened to fp32 32
// at a time (even elements, then odd: two instructions), the output accumulators in
// registers. Blocks must hold a multiple of 16 tokens: a block's last tokens past the
// context are read (inside the block) and masked out.

// Four tokens' vectors of partial sums -> one vector whose 128-bit lane L holds the four
// tokens' sums of their lane-L elements, in token order.
inline __m512 fold4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
}

// Adds 128-bit lanes pairwise: [x0 + x1, x2 + x3, y0 + y1, y2 + y3].
inline __m512 fold_lanes(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Four fold4 results (tokens 0-3, 4-7, 8-11, 12-15) -> the 16 tokens' whole sums, in order.
inline __m512 fold16(const __m512 quads[4]) {
  return fold_lanes(fold_lanes(quads[0], quads[1]), fold_lanes(quads[2], quads[3]));
}

// One query head's dot products with 16 key rows, `partial(row)` giving a row's vector of
// partial sums.
template <typename Partial>
inline __m512 dots16(Partial partial) {
  __m512 quads[4];
  for (int quad = 0; quad < 4; ++quad)
    quads[quad] = fold4(partial(4 * quad), partial(4 * quad + 1), partial(4 * quad + 2),
                        partial(4 * quad + 3));
  return fold16(quads);
}

// kDim / 16 fp32 vectors of one cache row. bf16 rows come as (even elements, odd elements)
// per 32: the accumulators hold dims in that order, and `dim_at` undoes it.
template <int kDim>
inline void load_row(const float* p, __m512* out) {
  for (int i = 0; i < kDim / 16; ++i) out[i] = _mm512_loadu_ps(p + 16 * i);
}
template <int kDim>
inline void load_row(const uint16_t* p, __m512* out) {
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  for (int c = 0; c < kDim / 32; ++c) {
    const __m512i raw = _mm512_loadu_si512(p + 32 * c);
    out[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    out[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
  }
}

// `ahead`: the 16 rows whose lines to fetch as these are read (prefetch_sixteenth), or nullptr.
template <int kDim, typename T>
inline __m512 dots16(const T* keys, const T* query, const char* ahead = nullptr) {
  constexpr int64_t kRowBytes = kDim * sizeof(T);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {  // bf16 pairs multiplied as they lie
    __m512bh qv[kDim / 32];
    for (int c = 0; c < kDim / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
    return dots16([&](int row) {
      prefetch_sixteenth<kRowBytes>(ahead, row);
      const uint16_t* k = keys + row * kDim;
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < kDim / 32; ++c)
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      return acc;
    });
  }
#endif
  // Query and key rows widened alike (bf16 in load_row's order): the sum is the same.
  __m512 qv[kDim / 16];
  load_row<kDim>(query, qv);
  return dots16([&](int row) {
    prefetch_sixteenth<kRowBytes>(ahead, row);
    __m512 kv[kDim / 16];
    load_row<kDim>(keys + row * kDim, kv);
    __m512 acc = _mm512_mul_ps(qv[0], kv[0]);
    for (int i = 1; i < kDim / 16; ++i) acc = _mm512_fmadd_ps(qv[i], kv[i], acc);
    return acc;
  });
}

// One KV head over one block: acc[g] (kDim floats, kDim apart) += the weights of query head g
// (`len` apart) of the first `count` tokens times their value rows, in vector registers.
template <typename T, int kDim, int kGroup>
inline void add_weighted_values(const T* values, const float* weights, int64_t len,
                                int64_t count, float* acc, const char* ahead) {
  constexpr int kVecs = kDim / 16;
  constexpr int64_t kRowBytes = kDim * sizeof(T);
  __m512 av[kGroup][kVecs];
  for (int g = 0; g < kGroup; ++g)
    for (int i = 0; i < kVecs; ++i) av[g][i] = _mm512_loadu_ps(acc + g * kDim + 16 * i);
  for (int64_t t = 0; t < count; ++t) {
    prefetch_for_row<kRowBytes>(ahead, t);
    __m512 value[kVecs];
    load_row<kDim>(values + t * kDim, value);
    for (int g = 0; g < kGroup; ++g) {
      const __m512 p = _mm512_set1_ps(weights[g * len + t]);
      for (int i = 0; i < kVecs; ++i) av[g][i] = _mm512_fmadd_ps(p, value[i], av[g][i]);
    }
  }
  for (int g = 0; g < kGroup; ++g)
    for (int i = 0; i < kVecs; ++i) _mm512_storeu_ps(acc + g * kDim + 16 * i, av[g][i]);
}

inline int64_t dim_at(const float*, int64_t i) { return i; }
inline int64_t dim_at(const uint16_t*, int64_t i) {
  const int64_t chunk = i / 32, j = i % 32;
  return 32 * chunk + (j < 16 ? 2 * j : 2 * (j - 16) + 1);
}

// 16 tokens' dot products with one query head times `scale`, capped where softcap > 0 and
// -inf outside `seen` (a sliding window's start): the `live` ones stored at `dst`, and
// returned.
inline __m512 stored_scores16(__m512 dots, __m512 scale, float softcap, __mmask16 live,
                              __mmask16 seen, float* dst) {
  dots = _mm512_mul_ps(dots, scale);
  if (softcap > 0.f) {
    alignas(64) float capped_dots[16];
    _mm512_store_ps(capped_dots, dots);
    for (float& dot : capped_dots) dot = capped(dot, softcap);
    dots = _mm512_load_ps(capped_dots);
  }
  dots = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), dots);
  _mm512_mask_storeu_ps(dst, live, dots);
  return dots;
}

// As stored_scores16, `max` raised to the largest seen one.
inline void keep_scores16(__m512 dots, __m512 scale, float softcap, __mmask16 live,
                          __mmask16 seen, float* dst, float& max) {
  dots = stored_scores16(dots, scale, softcap, live, seen, dst);
  if (seen) max = std::max(max, _mm512_mask_reduce_max_ps(seen, dots));
}

// As keep_scores16, raising each of 16 lane maxima (`top16`) instead of one: no reduction
// across lanes per block.
inline void keep_scores16(__m512 dots, __m512 scale, float softcap, __mmask16 live,
                          __mmask16 seen, float* dst, float* top16) {
  dots = stored_scores16(dots, scale, softcap, live, seen, dst);
  const __m512 top = _mm512_loadu_ps(top16);
  _mm512_storeu_ps(top16, _mm512_mask_max_ps(top, seen, top, dots));
}

// 8-bit rows (int8 or fp8 codes and their scale) in AVX-512: 16 codes widened to fp32 at a
// time, each widened row multiplied into every query head of the group; a token's scale
// applied to its 16-token vector of scores, and to its weight before its values are added.
// Walks blocks outermost like decode_one_simd, the task's heads adjacent in each block.
inline __m128i load16_bytes(const void* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16_bytes(p)));
}
inline __m512 load16(const E5m2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load16_bytes(p)), 8));
}
inline __m512 load16(const E4m3* p) {  // as load8: sign-extended, the fp16's bit 14 cleared
  const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(load16_bytes(p)), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(shifted, _mm256_set1_epi16(int16_t(0xbfff))));
}

// The scales of 16 rows, zero in the lanes past `live`.
template <typename C, int kDim>
inline __m512 row_scales16(const C* rows, __mmask16 live) {
  alignas(64) float scales[16];
  for (int i = 0; i < 16; ++i) scales[i] = row_scale(rows + i * row_width<C>(kDim), kDim);
  return _mm512_maskz_mov_ps(live, _mm512_load_ps(scales));
}

// The group's query heads (fp32, kDim apart) dotted with 16 rows' codes, before the scales;
// `ahead` as dots16's.
template <typename C, int kDim, int kGroup>
inline void code_dots16(const C* rows, const float* query, __m512 out[kGroup],
                        const char* ahead) {
  constexpr int kVecs = kDim / 16;
  constexpr int64_t kRowBytes = row_width<C>(kDim);
  __m512 quads[kGroup][4];
  for (int quad = 0; quad < 4; ++quad) {
    __m512 partial[4][kGroup];
    for (int i = 0; i < 4; ++i) {
      prefetch_sixteenth<kRowBytes>(ahead, 4 * quad + i);
      const C* row = rows + (4 * quad + i) * kRowBytes;
      __m512 codes[kVecs];
      for (int c = 0; c < kVecs; ++c) codes[c] = load16(row + 16 * c);
      for (int g = 0; g < kGroup; ++g) {
        const float* qg = query + g * kDim;
        __m512 acc = _mm512_mul_ps(codes[0], _mm512_loadu_ps(qg));
        for (int c = 1; c < kVecs; ++c)
          acc = _mm512_fmadd_ps(codes[c], _mm512_loadu_ps(qg + 16 * c), acc);
        partial[i][g] = acc;
      }
    }
    for (int g = 0; g < kGroup; ++g)
      quads[g][quad] = fold4(partial[0][g], partial[1][g], partial[2][g], partial[3][g]);
  }
  for (int g = 0; g < kGroup; ++g) out[g] = fold16(quads[g]);
}

// Vectors of dims a pass over a block's value rows keeps in registers: the group's sums
// (at most 24 vectors), the widened row and the weight.
template <int kDim, int kGroup>
constexpr int kCodePassVecs = kDim / 16 * kGroup <= 24 ? kDim / 16
                              : 4 * kGroup <= 24        ? 4
                              : 2 * kGroup <= 24        ? 2
                                                        : 1;

// As add_weighted_values, over `count` coded rows (each weight times its row's scale).
template <typename C, int kDim, int kGroup>
inline void add_weighted_codes(const C* rows, const float* weights, int64_t len,
                               int64_t count, float* acc, const char* ahead) {
  constexpr int kPass = kCodePassVecs<kDim, kGroup>;
  constexpr int64_t kRowBytes = row_width<C>(kDim);
  for (int part = 0; part < kDim; part += 16 * kPass) {
    __m512 sums[kGroup][kPass];
    for (int g = 0; g < kGroup; ++g)
      for (int c = 0; c < kPass; ++c) sums[g][c] = _mm512_loadu_ps(acc + g * kDim + part + 16 * c);
    for (int64_t t = 0; t < count; ++t) {
      if (part == 0) prefetch_for_row<kRowBytes>(ahead, t);
      const C* row = rows + t * kRowBytes;
      __m512 values[kPass];
      for (int c = 0; c < kPass; ++c) values[c] = load16(row + part + 16 * c);
      const float scale = row_scale(row, kDim);
      for (int g = 0; g < kGroup; ++g) {
        const __m512 weight = _mm512_set1_ps(weights[g * len + t] * scale);
        for (int c = 0; c < kPass; ++c) sums[g][c] = _mm512_fmadd_ps(weight, values[c], sums[g][c]);
      }
    }
    for (int g = 0; g < kGroup; ++g)
      for (int c = 0; c < kPass; ++c) _mm512_storeu_ps(acc + g * kDim + part + 16 * c, sums[g][c]);
  }
}

template <typename T, typename C, int kDim, int kGroup>
void decode_one_codes512(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                         int64_t, const Task& a, T* out, std::vector<float>& scores,
                         std::vector<float>& scratch) {
  constexpr int64_t kRow = kGroup * kDim;  // one KV head's query (or output) rows
  constexpr int64_t kRowBytes = row_width<C>(kDim);
  const int64_t bs = a.block_size, heads = a.num_task_heads;
  const int64_t block_elems = bs * kRowBytes;
  const auto [skipped, len, head_start, num_blocks] = Walk(a);
  table += skipped / bs;
  auto block_ptr = [&](const C* cache, int64_t b) {
    return cache + (table[b] * a.num_kv_heads + a.head) * block_elems;
  };
  using QueryCode = QueryCodes<kDim>;
  constexpr int64_t kCodeFloats = kInt8Products<T, C> ? sizeof(QueryCode) / sizeof(float) : 0;
  scratch.resize(2 * heads * kRow + 2 * heads * kGroup + heads * kGroup * kCodeFloats +
                 heads * kGroup * 16);
  float* query = scratch.data();  // [heads][kGroup][kDim], times the scale
  float* acc = query + heads * kRow;  // [heads][kGroup][kDim]
  float* maxes = acc + heads * kRow;  // [heads][kGroup]
  float* inv_sums = maxes + heads * kGroup;  // [heads][kGroup]
  scaled_query(q, a, heads * kGroup, kDim, query, kDim);
  std::fill(acc, acc + heads * kRow, 0.f);
  float* tops = inv_sums + heads * kGroup;  // [heads][kGroup][16]: the lanes' largest scores
  std::fill(tops, tops + heads * kGroup * 16, -INFINITY);
  auto* coded = reinterpret_cast<QueryCode*>(tops + heads * kGroup * 16);  // [heads][kGroup]
  if constexpr (kInt8Products<T, C>)
    for (int64_t i = 0; i < heads * kGroup; ++i) code_query<kDim>(query + i * kDim, coded[i]);
  scores.resize(heads * kGroup * len);
  float* s = scores.data();
  const int64_t span = heads * block_elems;  // bytes: codes are one byte
  const auto fetch = block_prefetch<C>(table, num_blocks, span, block_ptr);
  fetch.first_of(k_cache);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs, count = std::min(bs, len - start);
    const int64_t t0 = b == 0 ? head_start : 0;  // before it: outside the window
    for (int64_t h = 0; h < heads; ++h) {
      const C* rows = block_ptr(k_cache, b) + h * block_elems;
      const char* ahead = fetch.rows_ahead(k_cache, b, h * block_elems);
      float* sh = s + h * kGroup * len + start;
      float* top = tops + h * kGroup * 16;
      for (int64_t t = 0; t < count; t += 16) {
        const C* block_rows = rows + t * kRowBytes;
        const __mmask16 live = lanes_below(count - t);
        const __mmask16 seen = __mmask16(live & ~lanes_below(t0 - t));
        const char* rows_ahead = row_at(ahead, t, kRowBytes);
        __m512 dots[kGroup];
#if defined(LOOM_INT8_VNNI)
        if constexpr (kInt8Products<T, C>)
          int8_dots16<kDim, kGroup, kRowBytes>(
              block_rows, coded + h * kGroup, dots,
              [&](int row) { prefetch_sixteenth<kRowBytes>(rows_ahead, row); });
        else
#endif
          code_dots16<C, kDim, kGroup>(block_rows, query + h * kRow, dots, rows_ahead);
        // Read after the rows: first, the 16 scales on 17 lines stalled the walk on them.
        const __m512 scale16 = row_scales16<C, kDim>(block_rows, live);
        for (int g = 0; g < kGroup; ++g)
          keep_scores16(dots[g], scale16, a.softcap, live, seen, sh + g * len + t,
                        top + 16 * g);
      }
    }
  }
  for (int64_t i = 0; i < heads * kGroup; ++i)
    maxes[i] = _mm512_reduce_max_ps(_mm512_loadu_ps(tops + 16 * i));
  fetch.first_of(v_cache);
  softmax_rows(s, heads * kGroup, len, maxes, inv_sums);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs, count = std::min(bs, len - start);
    for (int64_t h = 0; h < heads; ++h)
      add_weighted_codes<C, kDim, kGroup>(block_ptr(v_cache, b) + h * block_elems,
                                          s + h * kGroup * len + start, len, count,
                                          acc + h * kRow,
                                          fetch.rows_ahead(v_cache, b, h * block_elems));
  }
  for (int64_t i = 0; i < heads * kGroup; ++i)
    for (int64_t d = 0; d < kDim; ++d)
      store(out + a.head * kRow + i * kDim + d, acc[i * kDim + d] * inv_sums[i]);
}


#if defined(LOOM_AMX_TILES)
// AMX: a block's scores for one KV head as one tile product, C[16 tokens][group] =
// K[16][kDim] . Q^T, K's rows loaded as they lie in the cache and Q^T laid out once per task
// as the bf16 pairs the tile multiply takes. Same products and fp32 sums as vdpbf16ps, in
// tiles.

// Shorter contexts (a prefill chunk's first rows, most of all) stay in vector registers: the
// tiles' setup per task costs more than they save below this (bench.decode_bandwidth).
constexpr int64_t kTilesFromTokens = 64;

// Score tiles: 0 = 16 key rows of 32 dims, 1 = Q^T for those 32 dims, 2 = the scores.
template <int kDim, int kGroup>
struct DecodeTiles {
  static constexpr int kChunks = kDim / 32;
  static constexpr int64_t kHeadWords = kChunks * 16 * kGroup;
  uint32_t* qt;  // [head][dim chunk][dim pair][query head], from the thread's scratch
  alignas(64) float tile[16][16];

  // Q^T of the task's KV heads' query rows (bf16 [heads][kGroup][kDim]); loads this
  // thread's tile shapes.
  DecodeTiles(const uint16_t* query, int64_t heads, std::vector<uint32_t>& scratch) {
    scratch.resize(heads * kHeadWords);
    qt = scratch.data();
    const uint32_t* query_pairs = reinterpret_cast<const uint32_t*>(query);
    for (int64_t h = 0; h < heads; ++h)
      for (int c = 0; c < kChunks; ++c)
        for (int p = 0; p < 16; ++p)
          for (int g = 0; g < kGroup; ++g)
            qt[((h * kChunks + c) * 16 + p) * kGroup + g] =
                query_pairs[(h * kGroup + g) * (kDim / 2) + 16 * c + p];
    TileConfig config;
    config.rows[0] = 16, config.colsb[0] = 64;
    config.rows[1] = 16, config.colsb[1] = 4 * kGroup;
    config.rows[2] = 16, config.colsb[2] = 4 * kGroup;
    _tile_loadconfig(&config);
  }
  ~DecodeTiles() { _tile_release(); }

  // Head h's dot products with 16 key rows (kDim apart): query head g's scores in out[g].
  void dots(const uint16_t* keys, int64_t h, __m512 out[kGroup]) {
    _tile_zero(2);
    for (int c = 0; c < kChunks; ++c) {
      _tile_loadd(0, keys + 32 * c, kDim * 2);
      _tile_loadd(1, qt + (h * kChunks + c) * 16 * kGroup, 4 * kGroup);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, tile, 64);
    const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80,
                                          64, 48, 32, 16, 0);
    for (int g = 0; g < kGroup; ++g) out[g] = _mm512_i32gather_ps(rows, &tile[0][g], 4);
  }

  // Values on tiles too where their sums fit in the six tiles left (head_dim 64: four): a
  // second tile configuration, loaded once the scores are done; tile 0 = the weights of 16
  // tokens (bf16, as the torch path rounds them), 1 = their value rows' 16 dims as token
  // pairs, 2.. = the sums of each 16 dims, kept in tiles over a head's whole walk.
  static constexpr bool kTiledValues = kDim == 64;
  alignas(64) uint16_t weights[kGroup][16];
  alignas(64) uint16_t pairs[kDim / 16][8][32];  // [16 dims][token pair][dim, token]

  void load_value_tiles() {
    TileConfig config;
    config.rows[0] = kGroup, config.colsb[0] = 32;
    config.rows[1] = 8, config.colsb[1] = 64;
    for (int j = 0; j < kDim / 16; ++j) config.rows[2 + j] = kGroup, config.colsb[2 + j] = 64;
    _tile_loadconfig(&config);
  }

  void zero_sums() {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
  }

  // The sums += the group's weights of `count` tokens (up to 16; rows `len` apart) times
  // their value rows (kDim apart). Tokens past `count` weigh 0 and their rows are read as
  // 0, whatever the block holds there.
  void accumulate(const float* probs, int64_t len, int64_t count, const uint16_t* values) {
    const __mmask16 live = lanes_below(count);
    for (int g = 0; g < kGroup; ++g)
      _mm256_store_si256(reinterpret_cast<__m256i*>(weights[g]),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, probs + g * len)));
    const __m512i zero = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      const uint16_t* first = values + 2 * i * kDim;
      for (int c = 0; c < kDim / 32; ++c) {
        const __m512i even = 2 * i < count ? _mm512_loadu_si512(first + 32 * c) : zero;
        const __m512i odd = 2 * i + 1 < count ? _mm512_loadu_si512(first + kDim + 32 * c) : zero;
        _mm512_store_si512(pairs[2 * c][i], _mm512_unpacklo_epi16(even, odd));
        _mm512_store_si512(pairs[2 * c + 1][i], _mm512_unpackhi_epi16(even, odd));
      }
    }
    _tile_loadd(0, weights, 32);
    _tile_loadd(1, pairs[0], 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(1, pairs[1], 64);
    _tile_dpbf16ps(3, 0, 1);
    _tile_loadd(1, pairs[2], 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(1, pairs[3], 64);
    _tile_dpbf16ps(5, 0, 1);
  }

  void store_sums(float* acc) {
    _tile_stored(2, acc, kDim * 4);
    _tile_stored(3, acc + 16, kDim * 4);
    _tile_stored(4, acc + 32, kDim * 4);
    _tile_stored(5, acc + 48, kDim * 4);
  }

  // The dim at position i of acc: unpacking pairs of rows interleaves four dims of each
  // 128-bit lane at a time, low halves first.
  static int64_t dim_of(int64_t i) {
    const int64_t j = i / 16, n = i % 16;
    return 32 * (j / 2) + 8 * (n / 4) + 4 * (j % 2) + n % 4;
  }
};
#endif

template <typename T, int kDim, int kGroup>
void decode_one_simd(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                     int64_t, const Task& a, T* out, std::vector<float>& scores,
                     std::vector<float>& scratch) {
  constexpr int64_t kRow = kGroup * kDim;  // one KV head's query (or output) rows
  const int64_t bs = a.block_size, heads = a.num_task_heads;
  const int64_t block_elems = bs * kDim;
  // As decode_one_head: the walk starts at the block holding `first`.
  const int64_t skipped = a.first / bs * bs, len = a.seq_len - skipped;
  const int64_t head_start = a.first - skipped;
  const int64_t num_blocks = (len + bs - 1) / bs;
  table += skipped / bs;
  // The task's heads are adjacent in a block: [block][kv head][token][dim]. Walking blocks
  // outermost reads the task's whole stretch of each block at once.
  auto block_ptr = [&](const T* cache, int64_t b) {
    return cache + (table[b] * a.num_kv_heads + a.head) * block_elems;
  };
  const int64_t span = heads * block_elems * int64_t(sizeof(T));
  // The thread's reused scratch: no allocation per task.
  scratch.resize(heads * kRow + 2 * heads * kGroup);
  float* acc = scratch.data();  // [heads][kGroup][kDim], dims in load_row's order
  float* maxes = acc + heads * kRow;  // [heads][kGroup]
  float* inv_sums = maxes + heads * kGroup;  // [heads][kGroup]
  std::fill(acc, acc + heads * kRow, 0.f);
  std::fill(maxes, maxes + heads * kGroup, -INFINITY);
  scores.resize(heads * kGroup * len);
  float* s = scores.data();
  const T* query = q + a.head * kRow;
  const __m512 scale = _mm512_set1_ps(a.scale);

  // The head's rows of the block kRowsAheadBlocks on: vectors fetch them a row at a time,
  // tiles (which read no row alone) the head's whole stretch as they start on this block.
  const int64_t head_bytes = block_elems * int64_t(sizeof(T));
  // Head h's scores over 16 key rows: tiles where the CPU has AMX, vectors elsewhere.
  auto score_vectors = [&](const T* keys, int64_t h, __m512 out[kGroup], const char* ahead) {
    for (int g = 0; g < kGroup; ++g)
      out[g] = dots16<kDim>(keys, query + (h * kGroup + g) * kDim, g == 0 ? ahead : nullptr);
  };
#if defined(LOOM_AMX_TILES)
  thread_local std::vector<uint32_t> qt_scratch;
  std::optional<DecodeTiles<kDim, kGroup>> tiles;
  if constexpr (std::is_same_v<T, uint16_t>)
    if (a.tiles && len >= kTilesFromTokens && amx_permitted())
      tiles.emplace(query, heads, qt_scratch);
  const bool tiled = tiles.has_value();
  auto score_rows = [&](const T* keys, int64_t h, __m512 out[kGroup], const char* ahead) {
    if constexpr (std::is_same_v<T, uint16_t>)
      if (tiles) return tiles->dots(keys, h, out);
    score_vectors(keys, h, out, ahead);
  };
#else
  constexpr bool tiled = false;
  auto& score_rows = score_vectors;
#endif

  const auto fetch = block_prefetch<T>(table, num_blocks, span, block_ptr);
  if (tiled) fetch.l2_window_of(k_cache, v_cache);
  fetch.first_of(k_cache);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs, count = std::min(bs, len - start);
    const int64_t t0 = b == 0 ? head_start : 0;  // before it: outside the window
    for (int64_t h = 0; h < heads; ++h) {
      const char* ahead = fetch.rows_ahead(k_cache, b, h * block_elems);
      if (tiled && ahead != nullptr) prefetch(ahead, head_bytes);
      const T* keys = block_ptr(k_cache, b) + h * block_elems;
      float* sh = s + h * kGroup * len + start;
      float* mh = maxes + h * kGroup;
      for (int64_t t = 0; t < count; t += 16) {
        const __mmask16 live = lanes_below(count - t);
        const __mmask16 seen = __mmask16(live & ~lanes_below(t0 - t));
        __m512 dots[kGroup];
        score_rows(keys + t * kDim, h, dots, row_at(ahead, t, kDim * sizeof(T)));
        for (int g = 0; g < kGroup; ++g)
          keep_scores16(dots[g], scale, a.softcap, live, seen, sh + g * len + t, mh[g]);
      }
    }
  }

  fetch.first_of(v_cache);
  softmax_rows(s, heads * kGroup, len, maxes, inv_sums);

  bool tiled_values = false;
#if defined(LOOM_AMX_TILES)
  if constexpr (std::is_same_v<T, uint16_t> && DecodeTiles<kDim, kGroup>::kTiledValues)
    if (tiles) {  // head by head, its sums in tiles over the whole walk
      tiled_values = true;
      tiles->load_value_tiles();
      for (int64_t h = 0; h < heads; ++h) {
        tiles->zero_sums();
        for (int64_t b = 0; b < num_blocks; ++b) {
          if (const char* ahead = fetch.rows_ahead(v_cache, b, h * block_elems))
            prefetch(ahead, head_bytes);
          const int64_t start = b * bs, count = std::min(bs, len - start);
          const T* values = block_ptr(v_cache, b) + h * block_elems;
          for (int64_t t = 0; t < count; t += 16)
            tiles->accumulate(s + h * kGroup * len + start + t, len, count - t,
                              values + t * kDim);
        }
        tiles->store_sums(acc + h * kRow);
      }
    }
#endif
  for (int64_t b = 0; b < num_blocks && !tiled_values; ++b) {
    const int64_t start = b * bs, count = std::min(bs, len - start);
    for (int64_t h = 0; h < heads; ++h)
      add_weighted_values<T, kDim, kGroup>(block_ptr(v_cache, b) + h * block_elems,
                                           s + h * kGroup * len + start, len, count,
                                           acc + h * kRow,
                                           fetch.rows_ahead(v_cache, b, h * block_elems));
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int g = 0; g < kGroup; ++g) {
      const float inv = inv_sums[h * kGroup + g];
      const float* row = acc + h * kRow + g * kDim;
      T* dst = out + a.head * kRow + h * kRow + g * kDim;
#if defined(LOOM_AMX_TILES)
      if (tiled_values) {
        for (int64_t i = 0; i < kDim; ++i)
          store(dst + DecodeTiles<kDim, kGroup>::dim_of(i), row[i] * inv);
        continue;
      }
#endif
      for (int64_t i = 0; i < kDim; ++i) store(dst + dim_at(dst, i), row[i] * inv);
    }
}

// A run's rows over its blocks, each block read from memory once for all of them. Each row's
// sums are the ones decode_one_simd makes for it in vector registers, in the same order (fp32:
// the same bits; bf16 contexts of 64 tokens and more take tiles there, vectors here).
template <typename T, int kDim, int kGroup>
void decode_run_simd(const Run<T>& run, const T* k_cache, const T* v_cache,
                     const int64_t* table, const Task& a, std::vector<float>& scores,
                     std::vector<float>& scratch) {
  constexpr int64_t kRow = kGroup * kDim;
  const int64_t bs = a.block_size, heads = a.num_task_heads, m = run.size;
  const int64_t block_elems = bs * kDim, len = run.lens[m - 1];
  const int64_t num_blocks = (len + bs - 1) / bs;
  auto block_ptr = [&](const T* cache, int64_t b) {
    return cache + (table[b] * a.num_kv_heads + a.head) * block_elems;
  };
  const int64_t span = heads * block_elems * int64_t(sizeof(T));
  const int64_t per_row = heads * kRow + 2 * heads * kGroup;  // acc, maxes, inv_sums
  scratch.resize(m * per_row);
  std::fill(scratch.begin(), scratch.end(), 0.f);
  int64_t score_start[kMaxRun + 1] = {0};
  for (int64_t r = 0; r < m; ++r) {
    float* maxes = scratch.data() + r * per_row + heads * kRow;
    std::fill(maxes, maxes + heads * kGroup, -INFINITY);
    score_start[r + 1] = score_start[r] + heads * kGroup * run.lens[r];
  }
  scores.resize(score_start[m]);
  const __m512 scale = _mm512_set1_ps(a.scale);
  constexpr int64_t kRowBytes = kDim * sizeof(T);
  const auto fetch = block_prefetch<T>(table, num_blocks, span, block_ptr);
  // As decode_one_simd's vectors; the longest row (the last) fetches.
  auto rows_ahead = [&](const T* cache, int64_t b, int64_t h, int64_t r) -> const char* {
    return r == m - 1 ? fetch.rows_ahead(cache, b, h * block_elems) : nullptr;
  };
  fetch.first_of(k_cache);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs;
    for (int64_t h = 0; h < heads; ++h) {
      const T* keys = block_ptr(k_cache, b) + h * block_elems;
      for (int64_t r = 0; r < m; ++r) {
        const int64_t len_r = run.lens[r], count = std::min(bs, len_r - start);
        const char* ahead = rows_ahead(k_cache, b, h, r);
        const T* query = run.q[r] + a.head * kRow;
        float* sh = scores.data() + score_start[r] + h * kGroup * len_r + start;
        float* mh = scratch.data() + r * per_row + heads * kRow + h * kGroup;
        for (int64_t t = 0; t < count; t += 16) {
          const __mmask16 live = lanes_below(count - t);
          for (int g = 0; g < kGroup; ++g) {
            const __m512 dots = dots16<kDim>(keys + t * kDim, query + (h * kGroup + g) * kDim,
                                             g == 0 ? row_at(ahead, t, kRowBytes) : nullptr);
            keep_scores16(dots, scale, a.softcap, live, live, sh + g * len_r + t, mh[g]);
          }
        }
      }
    }
  }

  fetch.first_of(v_cache);
  for (int64_t r = 0; r < m; ++r) {
    float* maxes = scratch.data() + r * per_row + heads * kRow;
    softmax_rows(scores.data() + score_start[r], heads * kGroup, run.lens[r], maxes,
                 maxes + heads * kGroup);
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * bs;
    for (int64_t h = 0; h < heads; ++h) {
      const T* values = block_ptr(v_cache, b) + h * block_elems;
      for (int64_t r = 0; r < m; ++r) {
        const int64_t len_r = run.lens[r], count = std::min(bs, len_r - start);
        add_weighted_values<T, kDim, kGroup>(
            values, scores.data() + score_start[r] + h * kGroup * len_r + start, len_r, count,
            scratch.data() + r * per_row + h * kRow, rows_ahead(v_cache, b, h, r));
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* acc = scratch.data() + r * per_row;
    const float* inv_sums = acc + heads * kRow + heads * kGroup;
    for (int64_t h = 0; h < heads; ++h)
      for (int g = 0; g < kGroup; ++g) {
        const float inv = inv_sums[h * kGroup + g];
        const float* row = acc + h * kRow + g * kDim;
        T* dst = run.out[r] + a.head * kRow + h * kRow + g * kDim;
        for (int64_t i = 0; i < kDim; ++i) store(dst + dim_at(dst, i), row[i] * inv);
      }
  }
}
#endif

template <typename T, typename C>
using DecodeOne = void (*)(const T*, const C*, const C*, const int64_t*, int64_t, const Task&,
                           T*, std::vector<float>&, std::vector<float>&);

constexpr int kMaxSimdGroup = 8;

// pick(std::integral_constant<int, G>{}) for the group G, 1..kMaxSimdGroup, else `none`: the
// compile-time group count of a SIMD kernel, chosen at run time.
template <int kGroup = 1, typename R, typename Pick>
R for_group(int64_t group, R none, Pick pick) {
  if constexpr (kGroup > kMaxSimdGroup) {
    (void)group, (void)pick;
    return none;
  } else {
    if (group == kGroup) return pick(std::integral_constant<int, kGroup>{});
    return for_group<kGroup + 1>(group, none, pick);
  }
}

// AVX-512 for blocks of a multiple of 16 tokens (8-bit rows in blocks of other sizes, and
// every row without AVX-512, take AVX2).
template <typename T, typename C, int kDim>
DecodeOne<T, C> simd_for_group(int64_t group, int64_t block_size) {
  const auto plain = DecodeOne<T, C>(decode_one<T, C, kDim>);
#if defined(__AVX512F__)
  if (block_size % 16 == 0) {
    if constexpr (kCoded<C>)
      return for_group(group, plain, [](auto g) -> DecodeOne<T, C> {
        return decode_one_codes512<T, C, kDim, decltype(g)::value>;
      });
    else if constexpr (std::is_same_v<T, C>)
      return for_group(group, plain, [](auto g) -> DecodeOne<T, C> {
        return decode_one_simd<T, kDim, decltype(g)::value>;
      });
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return for_group(group, plain, [](auto g) -> DecodeOne<T, C> {
    return decode_one_avx2<T, C, kDim, decltype(g)::value>;
  });
#endif
  (void)group, (void)block_size;
  return plain;
}

template <typename T, typename C>
DecodeOne<T, C> pick_decode_one(int64_t dim, int64_t group, int64_t block_size) {
  if (block_size % 16 != 0 && !kCoded<C>) return decode_one<T, C, 0>;
  if (dim == 64) return simd_for_group<T, C, 64>(group, block_size);
  if (dim == 128) return simd_for_group<T, C, 128>(group, block_size);
  return decode_one<T, C, 0>;
}

template <typename T, typename C>
using DecodeRun = void (*)(const Run<T>&, const C*, const C*, const int64_t*, const Task&,
                           std::vector<float>&, std::vector<float>&);

template <typename T, int kDim>
DecodeRun<T, T> run_for_group(int64_t group) {
#if defined(__AVX512F__)
  return for_group(group, DecodeRun<T, T>(nullptr), [](auto g) -> DecodeRun<T, T> {
    return decode_run_simd<T, kDim, decltype(g)::value>;
  });
#else
  (void)group;
  return nullptr;
#endif
}

// The run kernel where one serves these shapes (else each row of a run alone).
template <typename T, typename C>
DecodeRun<T, C> pick_decode_run(int64_t dim, int64_t group, int64_t block_size,
                                int64_t window) {
  if constexpr (!std::is_same_v<T, C>) {
    (void)dim, (void)group, (void)block_size, (void)window;
    return nullptr;
  } else {
    if (block_size % 16 != 0 || window > 0) return nullptr;
    if (dim == 64) return run_for_group<T, 64>(group);
    if (dim == 128) return run_for_group<T, 128>(group);
    return nullptr;
  }
}

// Where the runs' pieces begin (and the last one ends): each run whole, or, where its tasks
// would leave threads idle (one stream's verification: three KV heads' tasks on two
// threads), cut into consecutive rows enough to give each thread two tasks. A row's sums do
// not depend on the rows beside it in a run, so the cut changes no bits.
inline std::vector<int64_t> run_pieces(const int64_t* runs, int64_t num_runs,
                                       int64_t tasks_per_run, int threads) {
  std::vector<int64_t> bounds{0};
  const int64_t tasks = num_runs * tasks_per_run, wanted = 2 * int64_t(threads);
  const int64_t cuts = tasks >= wanted ? 1 : (wanted + tasks - 1) / tasks;
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t begin = runs ? runs[i] : i, end = runs ? runs[i + 1] : i + 1;
    const int64_t pieces = std::min(cuts, end - begin);
    for (int64_t k = 1; k <= pieces; ++k) bounds.push_back(begin + (end - begin) * k / pieces);
  }
  return bounds;
}

// Entries [runs[i], runs[i + 1]) are run i: rows of one request at consecutive positions,
// their block tables alike (runs == nullptr: every entry is a run of its own).
template <typename T, typename C>
void decode(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,
            const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
            const int64_t* rows, int64_t n, const int64_t* runs, int64_t num_runs,
            int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t dim,
            float scale, int64_t window, float softcap, bool tiles,
            T* out, int threads) {
  const int64_t group = num_heads / num_kv_heads;
  const DecodeOne<T, C> one = pick_decode_one<T, C>(dim, group, block_size);
  const DecodeRun<T, C> run_kernel = pick_decode_run<T, C>(dim, group, block_size, window);
  if (runs == nullptr) num_runs = n;
  // Enough runs to share out: one task per run, its heads read block by block. Few: one
  // task per (run, KV head), so every thread has work.
  const int64_t task_heads = num_runs >= kRequestsPerThread * threads ? num_kv_heads : 1;
  const int64_t tasks_per_run = num_kv_heads / task_heads;
  const std::vector<int64_t> bounds = run_pieces(runs, num_runs, tasks_per_run, threads);
  const int64_t num_pieces = int64_t(bounds.size()) - 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, tile;
    Run<T> run;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_pieces * tasks_per_run; ++item) {
      const int64_t i = item / tasks_per_run;
      const int64_t begin = bounds[i], end = bounds[i + 1];
      Task a{0, (item % tasks_per_run) * task_heads, task_heads, group, num_kv_heads,
             block_size, scale, 0, softcap, tiles};
      if (end - begin > 1 && run_kernel != nullptr) {
        run.size = end - begin;
        for (int64_t r = 0; r < run.size; ++r) {
          run.q[r] = q + rows[begin + r] * q_stride;
          run.out[r] = out + rows[begin + r] * num_heads * dim;
          run.lens[r] = seq_lens[begin + r];
        }
        run_kernel(run, k_cache, v_cache, tables + begin * table_stride, a, scores, tile);
        continue;
      }
      for (int64_t r = begin; r < end; ++r) {
        a.seq_len = seq_lens[r];
        a.first = window > 0 ? std::max<int64_t>(0, seq_lens[r] - window) : 0;
        one(q + rows[r] * q_stride, k_cache, v_cache, tables + r * table_stride, dim, a,
            out + rows[r] * num_heads * dim, scores, tile);
      }
    }
  }
}

// One row of values as int8 codes and their scale, the bits quantize_rows makes in torch.
template <typename T>
void quantize_row(const T* x, int64_t dim, int8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  float scale = amax / 127.f;
  if (!(scale > 0.f)) scale = 1.f;
  for (int64_t d = 0; d < dim; ++d)
    row[d] = int8_t(std::clamp(std::nearbyint(to_float(x[d]) / scale), -127.f, 127.f));
  std::memcpy(row + dim, &scale, sizeof scale);
}

template <typename T>
void write_codes(const char* k, int64_t k_stride, const char* v, int64_t v_stride,
                 int8_t* k_cache, int8_t* v_cache, const int64_t* rows, int64_t tokens,
                 int64_t heads, int64_t dim) {
  const int64_t width = row_width<int8_t>(dim);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = rows[t * heads + h];
      quantize_row(reinterpret_cast<const T*>(k + t * k_stride) + h * dim, dim,
                   k_cache + row * width);
      quantize_row(reinterpret_cast<const T*>(v + t * v_stride) + h * dim, dim,
                   v_cache + row * width);
    }
}

}  // namespace

// loom_write_kv into int8 caches: each head's row quantized (rows of dim + 4 bytes).
extern "C" void loom_write_kv_codes(const char* k, int64_t k_stride, const char* v,
                                    int64_t v_stride, int is_bf16, int8_t* k_cache,
                                    int8_t* v_cache, const int64_t* rows, int64_t tokens,
                                    int64_t heads, int64_t dim) {
  if (is_bf16)
    write_codes<uint16_t>(k, k_stride, v, v_stride, k_cache, v_cache, rows, tokens, heads, dim);
  else
    write_codes<float>(k, k_stride, v, v_stride, k_cache, v_cache, rows, tokens, heads, dim);
}

// Row rows[t * heads + h] of each cache (viewed as [rows, dim]) gets token t's head h of k
// (and of v): one plain copy per row, the new tokens' heads back to back in their rows.
extern "C" void loom_write_kv(const char* k, int64_t k_stride, const char* v, int64_t v_stride,
                              char* k_cache, char* v_cache, const int64_t* rows, int64_t tokens,
                              int64_t heads, int64_t row_bytes) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = rows[t * heads + h];
      std::memcpy(k_cache + row * row_bytes, k + t * k_stride + h * row_bytes, row_bytes);
      std::memcpy(v_cache + row * row_bytes, v + t * v_stride + h * row_bytes, row_bytes);
    }
}

// 1 where int8 keys under bf16 queries are multiplied as integers (int8_vnni.h), else 0.
extern "C" int loom_int8_key_products() { return kInt8Products<uint16_t, int8_t> ? 1 : 0; }

// codes: the caches hold 8-bit codes and scales, int8 (1), fp8 e4m3fn (2) or e5m2 (3);
// 0: values of q's dtype.
extern "C" int loom_paged_decode(int is_bf16, int codes, const void* q, int64_t q_stride,
                                 const void* k_cache, const void* v_cache, const int64_t* tables,
                                 int64_t table_stride, const int64_t* seq_lens,
                                 const int64_t* rows, int64_t n, const int64_t* runs,
                                 int64_t num_runs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t block_size, int64_t dim,
                                 float scale, int64_t window, float softcap, int tiles,
                                 void* out, int threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > kMaxGroup ||
      dim > kMaxDim)
    return 1;
  for (int64_t i = 0; runs != nullptr && i < num_runs; ++i) {  // short, ascending, inside n
    if (runs[i + 1] - runs[i] > kMaxRun || runs[i + 1] <= runs[i] || runs[i + 1] > n) return 2;
    for (int64_t r = runs[i] + 1; r < runs[i + 1]; ++r)
      if (seq_lens[r] < seq_lens[r - 1]) return 2;
  }
  auto run = [&](auto* typed_out, auto* typed_cache) {
    using T = std::remove_pointer_t<decltype(typed_out)>;
    using C = std::remove_const_t<std::remove_pointer_t<decltype(typed_cache)>>;
    decode(static_cast<const T*>(q), q_stride, static_cast<const C*>(k_cache),
           static_cast<const C*>(v_cache), tables, table_stride, seq_lens, rows, n, runs,
           num_runs, num_heads, num_kv_heads, block_size, dim, scale, window, softcap,
           tiles != 0, typed_out, threads);
  };
  auto for_caches = [&](auto* typed_out, auto* plain) {
    if (codes == 1)
      run(typed_out, static_cast<const int8_t*>(nullptr));
    else if (codes == 2)
      run(typed_out, static_cast<const E4m3*>(nullptr));
    else if (codes == 3)
      run(typed_out, static_cast<const E5m2*>(nullptr));
    else
      run(typed_out, plain);
  };
  if (is_bf16)
    for_caches(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(nullptr));
  else
    for_caches(static_cast<float*>(out), static_cast<const float*>(nullptr));
  return 0;
}
