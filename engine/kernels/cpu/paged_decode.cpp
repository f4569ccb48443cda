// Plain C++ (no torch headers: it compiles in seconds). One OpenMP task per (request, kv
// head), or per request when there are enough requests, reads its blocks straight from the
// paged cache: the next few blocks prefetched into L1, a window of its K and V into L2,
// and keeps scores, softmax and accumulators in fp32. Where the CPU has AVX-512, head_dim 64
// and 128 with up to 8 query heads per KV head take a path with the query and accumulators
// in registers; elsewhere the compiler vectorizes the plain loops.
#include "numerics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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

// Where a task's blocks are fetched ahead of its walk (over K, then over V): at its start
// the first `window` blocks of K and V into L2 (a block stored right after its predecessor
// left to the hardware), and the first few of the cache walked into L1; then, per block b
// read, block b + kPrefetchAhead into L1 and block b + window into L2.
template <typename T, typename BlockPtr>
struct BlockPrefetch {
  const int64_t* table;
  int64_t num_blocks, span, window;
  BlockPtr block_ptr;  // (cache, block index) -> the task's stretch of that block

  void l2_window_of(const T* k_cache, const T* v_cache) const {
    for (int64_t b = 0; b < std::min(window, num_blocks); ++b) {
      if (scattered(table, b)) {
        prefetch_l2(block_ptr(k_cache, b), span);
        prefetch_l2(block_ptr(v_cache, b), span);
      }
    }
  }

  void first_of(const T* cache) const {
    for (int64_t b = 0; b < std::min(kPrefetchAhead, num_blocks); ++b)
      prefetch(block_ptr(cache, b), span);
  }

  void past(const T* cache, int64_t b) const {
    if (b + kPrefetchAhead < num_blocks) prefetch(block_ptr(cache, b + kPrefetchAhead), span);
    if (b + window < num_blocks && scattered(table, b + window))
      prefetch_l2(block_ptr(cache, b + window), span);
  }
};

template <typename T, typename BlockPtr>
BlockPrefetch<T, BlockPtr> block_prefetch(const int64_t* table, int64_t num_blocks,
                                          int64_t span, BlockPtr block_ptr) {
  return {table, num_blocks, span, l2_window(span), block_ptr};
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
};

inline float capped(float s, float softcap) {
  return softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
}

// One (request, kv head): the scores of its `group` query heads over the context, softmax,
// then the weighted sum of values. kDim > 0 fixes head_dim at compile time.
template <typename T, int kDim>
void decode_one_head(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                     int64_t dim_arg, const Task& a, T* out, std::vector<float>& scores,
                     std::vector<float>& tile) {
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  const int64_t bs = a.block_size, group = a.group;
  const int64_t block_elems = bs * dim;
  // The walk covers the blocks from the one holding `first`; positions count from its start.
  const int64_t skipped = a.first / bs * bs, len = a.seq_len - skipped;
  const int64_t head_start = a.first - skipped;  // positions before it are outside the window
  const int64_t num_blocks = (len + bs - 1) / bs;
  table += skipped / bs;
  alignas(64) float query[kMaxGroup][kMaxDim];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d)
      query[g][d] = to_float(q[(a.head * group + g) * dim + d]) * a.scale;
  scores.resize(group * len);
  tile.resize(block_elems);
  float* kf = tile.data();
  auto block_ptr = [&](const T* cache, int64_t b) {
    return cache + (table[b] * a.num_kv_heads + a.head) * block_elems;
  };

  const int64_t span = block_elems * int64_t(sizeof(T));
  const auto ahead = block_prefetch<T>(table, num_blocks, span, block_ptr);
  ahead.l2_window_of(k_cache, v_cache);
  ahead.first_of(k_cache);
  float maxes[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) maxes[g] = -INFINITY;
  for (int64_t b = 0; b < num_blocks; ++b) {
    ahead.past(k_cache, b);
    const int64_t start = b * bs, count = std::min(bs, len - start);
    const T* keys = block_ptr(k_cache, b);
    for (int64_t i = 0; i < count * dim; ++i) kf[i] = to_float(keys[i]);
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
    const T* values = block_ptr(v_cache, b);
    for (int64_t i = 0; i < count * dim; ++i) kf[i] = to_float(values[i]);
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

template <typename T, int kDim>
void decode_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t dim_arg, const Task& a, T* out, std::vector<float>& scores,
                std::vector<float>& tile) {
  for (int64_t h = a.head; h < a.head + a.num_task_heads; ++h) {
    Task one = a;
    one.head = h;
    one.num_task_heads = 1;
    decode_one_head<T, kDim>(q, k_cache, v_cache, table, dim_arg, one, out, scores, tile);
  }
}

#if defined(__AVX512F__)
// AVX-512: head_dim a multiple of 16 and the group fixed at compile time, so the scaled
// query rows and the output accumulators stay in registers and each K/V row is loaded and
// widened to fp32 once for the whole group.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T, int kDim, int kGroup>
void decode_one_simd(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                     int64_t, const Task& a, T* out, std::vector<float>& scores,
                     std::vector<float>& scratch) {
  constexpr int kVecs = kDim / 16;
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
  scratch.resize(2 * heads * kRow + 2 * heads * kGroup);
  float* query = scratch.data();  // [heads][kGroup][kDim], scaled
  float* acc = query + heads * kRow;  // [heads][kGroup][kDim]
  float* maxes = acc + heads * kRow;  // [heads][kGroup]
  float* inv_sums = maxes + heads * kGroup;  // [heads][kGroup]
  for (int64_t i = 0; i < heads * kRow; ++i) {
    query[i] = to_float(q[a.head * kRow + i]) * a.scale;
    acc[i] = 0.f;
  }
  std::fill(maxes, maxes + heads * kGroup, -INFINITY);
  scores.resize(heads * kGroup * len);
  float* s = scores.data();

  const auto ahead = block_prefetch<T>(table, num_blocks, span, block_ptr);
  ahead.l2_window_of(k_cache, v_cache);
  ahead.first_of(k_cache);
  for (int64_t b = 0; b < num_blocks; ++b) {
    ahead.past(k_cache, b);
    const int64_t start = b * bs, count = std::min(bs, len - start);
    for (int64_t h = 0; h < heads; ++h) {
      const T* keys = block_ptr(k_cache, b) + h * block_elems;
      __m512 qv[kGroup][kVecs];
      for (int g = 0; g < kGroup; ++g)
        for (int i = 0; i < kVecs; ++i)
          qv[g][i] = _mm512_loadu_ps(query + h * kRow + g * kDim + 16 * i);
      float* sh = s + h * kGroup * len;
      float* mh = maxes + h * kGroup;
      const int64_t t0 = b == 0 ? head_start : 0;
      for (int g = 0; g < kGroup; ++g)
        std::fill(sh + g * len + start, sh + g * len + start + t0, -INFINITY);
      for (int64_t t = t0; t < count; ++t) {
        __m512 key[kVecs];
        for (int i = 0; i < kVecs; ++i) key[i] = load16(keys + t * kDim + 16 * i);
        for (int g = 0; g < kGroup; ++g) {
          __m512 dot = _mm512_mul_ps(qv[g][0], key[0]);
          for (int i = 1; i < kVecs; ++i) dot = _mm512_fmadd_ps(qv[g][i], key[i], dot);
          const float score = capped(_mm512_reduce_add_ps(dot), a.softcap);
          sh[g * len + start + t] = score;
          mh[g] = std::max(mh[g], score);
        }
      }
    }
  }

  ahead.first_of(v_cache);
  softmax_rows(s, heads * kGroup, len, maxes, inv_sums);

  for (int64_t b = 0; b < num_blocks; ++b) {
    ahead.past(v_cache, b);
    const int64_t start = b * bs, count = std::min(bs, len - start);
    for (int64_t h = 0; h < heads; ++h) {
      const T* values = block_ptr(v_cache, b) + h * block_elems;
      const float* sh = s + h * kGroup * len + start;
      float* ah = acc + h * kRow;
      __m512 av[kGroup][kVecs];
      for (int g = 0; g < kGroup; ++g)
        for (int i = 0; i < kVecs; ++i) av[g][i] = _mm512_loadu_ps(ah + g * kDim + 16 * i);
      for (int64_t t = 0; t < count; ++t) {
        __m512 value[kVecs];
        for (int i = 0; i < kVecs; ++i) value[i] = load16(values + t * kDim + 16 * i);
        for (int g = 0; g < kGroup; ++g) {
          const __m512 p = _mm512_set1_ps(sh[g * len + t]);
          for (int i = 0; i < kVecs; ++i) av[g][i] = _mm512_fmadd_ps(p, value[i], av[g][i]);
        }
      }
      for (int g = 0; g < kGroup; ++g)
        for (int i = 0; i < kVecs; ++i) _mm512_storeu_ps(ah + g * kDim + 16 * i, av[g][i]);
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int g = 0; g < kGroup; ++g) {
      const float inv = inv_sums[h * kGroup + g];
      const float* row = acc + h * kRow + g * kDim;
      T* dst = out + a.head * kRow + h * kRow + g * kDim;
      for (int64_t d = 0; d < kDim; ++d) store(dst + d, row[d] * inv);
    }
}
#endif

template <typename T>
using DecodeOne = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, const Task&,
                           T*, std::vector<float>&, std::vector<float>&);

template <typename T, int kDim>
DecodeOne<T> simd_for_group(int64_t group) {
#if defined(__AVX512F__)
  switch (group) {
    case 1: return decode_one_simd<T, kDim, 1>;
    case 2: return decode_one_simd<T, kDim, 2>;
    case 3: return decode_one_simd<T, kDim, 3>;
    case 4: return decode_one_simd<T, kDim, 4>;
    case 5: return decode_one_simd<T, kDim, 5>;
    case 6: return decode_one_simd<T, kDim, 6>;
    case 7: return decode_one_simd<T, kDim, 7>;
    case 8: return decode_one_simd<T, kDim, 8>;
  }
#endif
  (void)group;
  return decode_one<T, kDim>;
}

template <typename T>
DecodeOne<T> pick_decode_one(int64_t dim, int64_t group) {
  if (dim == 64) return simd_for_group<T, 64>(group);
  if (dim == 128) return simd_for_group<T, 128>(group);
  return decode_one<T, 0>;
}

template <typename T>
void decode(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
            const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
            const int64_t* rows, int64_t n, int64_t num_heads, int64_t num_kv_heads,
            int64_t block_size, int64_t dim, float scale, int64_t window, float softcap,
            T* out, int threads) {
  const DecodeOne<T> one = pick_decode_one<T>(dim, num_heads / num_kv_heads);
  // Enough requests to share out: one task per request, its heads read block by block. Few:
  // one task per (request, KV head), so every thread has work.
  const int64_t task_heads = n >= kRequestsPerThread * threads ? num_kv_heads : 1;
  const int64_t tasks_per_request = num_kv_heads / task_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, tile;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n * tasks_per_request; ++item) {
      const int64_t r = item / tasks_per_request;
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[r] - window) : 0;
      const Task a{seq_lens[r], (item % tasks_per_request) * task_heads, task_heads,
                   num_heads / num_kv_heads, num_kv_heads, block_size, scale, first, softcap};
      one(q + rows[r] * q_stride, k_cache, v_cache, tables + r * table_stride, dim, a,
          out + rows[r] * num_heads * dim, scores, tile);
    }
  }
}

}  // namespace

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

extern "C" int loom_paged_decode(int is_bf16, const void* q, int64_t q_stride,
                                 const void* k_cache, const void* v_cache, const int64_t* tables,
                                 int64_t table_stride, const int64_t* seq_lens,
                                 const int64_t* rows, int64_t n, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t block_size, int64_t dim,
                                 float scale, int64_t window, float softcap, void* out,
                                 int threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > kMaxGroup ||
      dim > kMaxDim)
    return 1;
  if (is_bf16)
    decode(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(k_cache),
           static_cast<const uint16_t*>(v_cache), tables, table_stride, seq_lens, rows, n,
           num_heads, num_kv_heads, block_size, dim, scale, window, softcap,
           static_cast<uint16_t*>(out), threads);
  else
    decode(static_cast<const float*>(q), q_stride, static_cast<const float*>(k_cache),
           static_cast<const float*>(v_cache), tables, table_stride, seq_lens, rows, n,
           num_heads, num_kv_heads, block_size, dim, scale, window, softcap,
           static_cast<float*>(out), threads);
  return 0;
}
