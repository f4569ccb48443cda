// Prefill attention over the paged cache: flash attention with the key axis down the tiles.
// One task per (chunk, query head, 16 query rows): the scores of 16 keys for the 16 queries
// are one product S^T = K . Q^T (the keys' rows as they lie in the cache, Q^T laid out once
// per task as the bf16 pairs a dot product of pairs takes); the online softmax runs over 32
// keys at a time in vectors of the 16 queries, so no sum or maximum crosses lanes; and the
// weighted values accumulate as O^T += V^T . P^T, V^T laid out once per (chunk, KV head)
// before the tasks. The products run on AMX tiles where the CPU has them, else on AVX512-BF16
// vectors (vdpbf16ps, a query a lane, a key's dim pair broadcast). bf16 caches only: callers
// ask loom_prefill_kind() first.
#include "amx.h"
#include "avx512.h"
#include "bf16_vectors.h"
#include "numerics.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(LOOM_AMX_TILES) || (defined(__AVX512BF16__) && defined(__AVX512BW__))
#define LOOM_PREFILL_KERNEL 1
#endif

namespace {

#if defined(LOOM_PREFILL_KERNEL)

constexpr int kRows = 16;  // query rows per task: a tile's columns
constexpr int kStep = 32;  // keys per softmax step: the depth of one value tile
constexpr int64_t kMaxDim = 256;

struct Shape {
  int64_t num_heads, num_kv_heads, block_size, dim;
  float scale;
  int64_t window;  // > 0: each query sees its last `window` keys
  float softcap;  // > 0: every scaled score s becomes softcap * tanh(s / softcap)
  bool tiles;  // the products on AMX tiles (else in vector registers)

  int64_t group() const { return num_heads / num_kv_heads; }
};

// A request's chunk of new rows: rows [q_start, q_start + query_len) of q sit at the end of
// its context of seq_len keys.
struct Chunk {
  int64_t q_start, query_len, seq_len;
  const int64_t* table;
  uint16_t* values_t;  // [kv head][key / kStep][dim][kStep]: V^T in tiles, zeros past seq_len

  int64_t padded_len() const { return (seq_len + kStep - 1) / kStep * kStep; }
  int64_t first_pos() const { return seq_len - query_len; }  // the position of its row 0
};

// softcap * tanh(s / softcap), tanh(y) as 1 - 2 / (e^2y + 1).
inline __m512 capped16(__m512 s, float softcap) {
  const __m512 e = exp2_16(_mm512_mul_ps(s, _mm512_set1_ps(2.f * kLog2e / softcap)));
  const __m512 tanh = _mm512_sub_ps(
      _mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  return _mm512_mul_ps(tanh, _mm512_set1_ps(softcap));
}

const uint16_t* key_rows(const uint16_t* cache, const Chunk& c, int64_t kv_head, int64_t key,
                         const Shape& s) {
  const int64_t bs = s.block_size;
  return cache + ((c.table[key / bs] * s.num_kv_heads + kv_head) * bs + key % bs) * s.dim;
}

// Where V^T of keys [first, first + kStep) of a chunk's KV head lies: a row of kStep keys
// per dim, rows back to back (a tile's 16 rows in one KiB, not a context's length apart).
inline uint16_t* values_t_at(const Chunk& c, int64_t kv_head, int64_t first, const Shape& s) {
  return c.values_t + (kv_head * c.padded_len() + first) * s.dim;
}

void lay_out_values(const uint16_t* v_cache, const Chunk& c, int64_t kv_head, int64_t first,
                    const Shape& s) {
  const uint16_t* rows[kStep];
  for (int j = 0; j < kStep; ++j)
    rows[j] = first + j < c.seq_len ? key_rows(v_cache, c, kv_head, first + j, s) : nullptr;
  uint16_t* dst = values_t_at(c, kv_head, first, s);
  for (int64_t d = 0; d < s.dim; ++d)
    for (int j = 0; j < kStep; ++j) dst[d * kStep + j] = rows[j] ? rows[j][d] : 0;
}

// One thread's working set: the task's queries, the step's scores and weights, and the
// output sums, each as a tile reads or writes it.
struct Scratch {
  alignas(64) uint32_t queries_t[kMaxDim / 32][16][kRows];  // [dim chunk][dim pair][query]
  // Two of each: a step's scores come out of the tiles while the one before is weighed.
  alignas(64) float scores[2][kStep][kRows];  // S^T
  alignas(64) uint32_t weights_t[2][kStep / 2][kRows];  // P^T as bf16 pairs: [key pair][query]
  alignas(64) float sums[kMaxDim][kRows];  // O^T
};

#if defined(LOOM_AMX_TILES)
// Tiles, all 16 rows of 64 bytes: 0 = A (16 key rows of 32 dims, or 16 dims of 32 keys);
// 1 = B (Q^T, or P^T); 2, 3 = the scores of a step's two halves (then A, as 0); 4-7 = the
// sums of 64 dims, kept in the tiles over a task's walk where the head has no more.
void load_tile_shapes() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}
#endif

// A bf16 pair (two adjacent values) in every lane.
inline __m512bh pair_in_lanes(const uint16_t* pair) {
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(pair));
}

// Vector products, 16 queries a lane each. scores[r] = S^T row r for 16 key rows `dim`
// apart: the queries' dim pairs against each key's (the same sums, pair by pair, as a tile's).
inline void score_16_keys(const uint32_t* queries_t, const uint16_t* keys, int64_t dim,
                          float (*scores)[16]) {
  __m512 sums[16];
  for (__m512& sum : sums) sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim / 2; ++i) {
    const __m512bh queries = (__m512bh)_mm512_load_si512(queries_t + i * 16);
    for (int r = 0; r < 16; ++r)
      sums[r] = _mm512_dpbf16_ps(sums[r], queries, pair_in_lanes(keys + r * dim + 2 * i));
  }
  for (int r = 0; r < 16; ++r) _mm512_store_ps(scores[r], sums[r]);
}

// sums[d] += V^T[d] . P^T for `dims` dims: each dim's 16 key pairs against the weights' pairs.
inline void accumulate_values(const uint32_t (*weights_t)[16], const uint16_t* values_t,
                              int64_t dims, int64_t step, float (*sums)[16]) {
  __m512bh weights[16];
  for (int k = 0; k < 16; ++k) weights[k] = (__m512bh)_mm512_load_si512(weights_t[k]);
  for (int64_t d = 0; d < dims; d += 8) {  // dims: a multiple of 32
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_load_ps(sums[d + j]);
    for (int k = 0; k < 16; ++k)
      for (int j = 0; j < 8; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], weights[k],
                                  pair_in_lanes(values_t + (d + j) * step + 2 * k));
    for (int j = 0; j < 8; ++j) _mm512_store_ps(sums[d + j], acc[j]);
  }
}

constexpr int64_t kResidentDims = 64;

// A query's running max (in log2 units) is raised only when a step's scores pass it by more
// than this, so the sums are rescaled a few times a walk instead of at most steps; its
// weights then reach up to 2^12, far inside fp32 and bf16.
constexpr float kRaiseMaxBy = 12.f;

// Weights of two keys for 16 queries -> one row of P^T: each query's two bf16 side by side.
inline __m512i key_pair(__m512 even, __m512 odd) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even x16, odd x16]
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, both);
}

class RowBlock {
 public:
  RowBlock(const uint16_t* q, int64_t q_stride, const Chunk& c, int64_t head, int64_t row0,
           const Shape& s, Scratch& w)
      : c_(c), s_(s), w_(w), head_(head), row0_(row0),
        rows_(std::min<int64_t>(kRows, c.query_len - row0)), first_(c.first_pos() + row0),
        resident_(s.tiles && s.dim <= kResidentDims) {
    // Q^T: 16 dim pairs of the 16 rows at a time, transposed (rows past the chunk as 0).
    const auto* pairs = reinterpret_cast<const int*>(q + (c.q_start + row0) * q_stride +
                                                     head * s.dim);
    for (int64_t chunk = 0; chunk < s.dim / 32; ++chunk) {
      __m512 block[16];
      for (int r = 0; r < 16; ++r)
        block[r] = r < rows_ ? _mm512_loadu_ps(pairs + r * (q_stride / 2) + 16 * chunk)
                             : _mm512_setzero_ps();
      transpose16(block);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(w.queries_t[chunk][i], block[i]);
    }
  }

  // Keys [begin, end): the first step's start is a multiple of kStep.
  int64_t begin() const {
    const int64_t first = s_.window > 0 ? std::max<int64_t>(0, first_ - s_.window + 1) : 0;
    return first / kStep * kStep;
  }
  int64_t end() const { return first_ + rows_; }

  void attend(const uint16_t* k_cache, uint16_t* out) {
    std::fill(&w_.sums[0][0], &w_.sums[0][0] + s_.dim * kRows, 0.f);
    if (resident_) load_sums(0);
    max_ = _mm512_set1_ps(-INFINITY);
    total_ = _mm512_setzero_ps();
    // The next step's scores are asked of the tiles before this step's weights are made
    // in vector registers: the two overlap.
    int buffer = 0;
    if (begin() < end()) score(k_cache, begin(), buffer);
    for (int64_t key = begin(); key < end(); key += kStep, buffer ^= 1) {
      if (key + kStep < end()) score(k_cache, key + kStep, buffer ^ 1);
      weigh(key, buffer);
      accumulate(key, buffer);
    }
    if (resident_) store_sums(0);
    write_out(out);
  }

 private:
  // S^T of keys [key, key + kStep) into scores (a half at or past end() left 0: masked).
  void score(const uint16_t* k_cache, int64_t key, int buffer) {
    const int64_t kv_head = head_ / s_.group();
    const uint16_t* low = key_rows(k_cache, c_, kv_head, key, s_);
    const uint16_t* high = key + 16 < end() ? key_rows(k_cache, c_, kv_head, key + 16, s_)
                                            : nullptr;
    if (!s_.tiles) {
      const uint32_t* queries_t = &w_.queries_t[0][0][0];
      score_16_keys(queries_t, low, s_.dim, w_.scores[buffer]);
      if (high != nullptr)
        score_16_keys(queries_t, high, s_.dim, w_.scores[buffer] + 16);
      else
        std::fill(&w_.scores[buffer][16][0], &w_.scores[buffer][16][0] + 16 * kRows, 0.f);
      return;
    }
#if defined(LOOM_AMX_TILES)
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ch = 0; ch < s_.dim / 32; ++ch) {
      _tile_loadd(1, w_.queries_t[ch], 64);
      _tile_loadd(0, low + 32 * ch, s_.dim * 2);
      _tile_dpbf16ps(2, 0, 1);
      if (high == nullptr) continue;
      _tile_loadd(0, high + 32 * ch, s_.dim * 2);
      _tile_dpbf16ps(3, 0, 1);
    }
    _tile_stored(2, w_.scores[buffer][0], 64);
    _tile_stored(3, w_.scores[buffer][16], 64);
#endif
  }

  // Every row of the block sees every key of the step, and no cap transforms the scores.
  bool plain_step(int64_t key) const {
    return s_.softcap == 0.f && key + kStep - 1 <= first_ &&
           (s_.window == 0 || key + s_.window > end() - 1);
  }

  // The step's scores -> weights 2^(u - max) as P^T, u = the scaled (capped) score in log2
  // units, -inf where a query does not see the key; the running max raised (and the sums
  // rescaled) where the scores passed it by kRaiseMaxBy; the total updated. A row's weights
  // and sums come out the same, bit for bit, whichever rows share its block and whether a
  // step is plain for the block: what a row computes does not depend on how its prompt was
  // chunked.
  void weigh(int64_t key, int buffer) {
    float (*scores)[kRows] = w_.scores[buffer];
    const bool plain = plain_step(key);
    // A plain step's u is its score times this, taken as the weights are made.
    const __m512 to_log2 = _mm512_set1_ps(plain ? s_.scale * kLog2e : 1.f);
    __m512 maxes[4];
    for (__m512& m : maxes) m = _mm512_set1_ps(-INFINITY);
    if (plain) {
      for (int r = 0; r < kStep; ++r)
        maxes[r % 4] = _mm512_max_ps(maxes[r % 4], _mm512_load_ps(scores[r]));
    } else {
      for (int r = 0; r < kStep; ++r) {
        const __m512 score = _mm512_load_ps(scores[r]);
        __m512 u = s_.softcap > 0.f
            ? _mm512_mul_ps(capped16(_mm512_mul_ps(score, _mm512_set1_ps(s_.scale)), s_.softcap),
                            _mm512_set1_ps(kLog2e))
            : _mm512_mul_ps(score, _mm512_set1_ps(s_.scale * kLog2e));  // as a plain step
        const int64_t lag = key + r - first_;  // query j sees this key from j = lag on
        __mmask16 seen = __mmask16(~lanes_below(lag));
        if (s_.window > 0) seen &= lanes_below(lag + s_.window);
        u = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), u);
        _mm512_store_ps(scores[r], u);
        maxes[r % 4] = _mm512_max_ps(maxes[r % 4], u);
      }
    }
    const __m512 step_max = _mm512_mul_ps(
        _mm512_max_ps(_mm512_max_ps(maxes[0], maxes[1]), _mm512_max_ps(maxes[2], maxes[3])),
        to_log2);
    const __mmask16 raise = _mm512_cmp_ps_mask(
        step_max, _mm512_add_ps(max_, _mm512_set1_ps(kRaiseMaxBy)), _CMP_GT_OQ);
    if (raise) {
      const __m512 raised = _mm512_mask_mov_ps(max_, raise, step_max);
      rescale(_mm512_mask_mov_ps(_mm512_set1_ps(1.f), raise,
                                 exp2_16(_mm512_sub_ps(max_, raised))));
      max_ = raised;
    }
    // A query that has seen no key yet keeps 0 as its reference: its weights stay ~0, not NaN.
    const __m512 ref = _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(max_, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), max_);
    __m512 totals[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int k = 0; k < kStep / 2; ++k) {
      __m512 p[2];
      for (int i = 0; i < 2; ++i) {
        const __m512 u = _mm512_mul_ps(_mm512_load_ps(scores[2 * k + i]), to_log2);
        p[i] = exp2_16(_mm512_sub_ps(u, ref));
        if (!plain)  // a key a query does not see weighs exactly 0
          p[i] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                     p[i]);
      }
      // The total adds the weights as rounded to bf16, as the value tiles multiply them: a
      // softmax dominated by one key then gives that key's value back exactly.
      const __m512i pair = key_pair(p[0], p[1]);
      _mm512_store_si512(w_.weights_t[buffer][k], pair);
      totals[0] = _mm512_add_ps(totals[0], _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
      totals[1] = _mm512_add_ps(totals[1], _mm512_castsi512_ps(
          _mm512_and_si512(pair, _mm512_set1_epi32(int(0xffff0000u)))));
    }
    total_ = _mm512_add_ps(total_, _mm512_add_ps(totals[0], totals[1]));
  }

  void rescale(__m512 alpha) {
    total_ = _mm512_mul_ps(total_, alpha);
    if (resident_) store_sums(0);
    for (int64_t d = 0; d < s_.dim; ++d)
      _mm512_store_ps(w_.sums[d], _mm512_mul_ps(_mm512_load_ps(w_.sums[d]), alpha));
    if (resident_) load_sums(0);
  }

  // O^T += V^T[:, key : key + kStep] . P^T: 64 dims at a time in tiles 4-7, each 16 dims'
  // values through tiles 0, 2 and 3 in turn.
  void accumulate(int64_t key, int buffer) {
    const uint16_t* values_t = values_t_at(c_, head_ / s_.group(), key, s_);
    if (!s_.tiles) {
      accumulate_values(w_.weights_t[buffer], values_t, s_.dim, kStep, w_.sums);
      return;
    }
#if defined(LOOM_AMX_TILES)
    _tile_loadd(1, w_.weights_t[buffer], 64);
    for (int64_t d = 0; d < s_.dim; d += kResidentDims) {
      if (!resident_) load_sums(d);
      const int64_t groups = std::min<int64_t>(4, (s_.dim - d) / 16);
      const uint16_t* v = values_t + d * kStep;
      _tile_loadd(0, v, kStep * 2);
      _tile_dpbf16ps(4, 0, 1);
      if (groups > 1) {
        _tile_loadd(2, v + 16 * kStep, kStep * 2);
        _tile_dpbf16ps(5, 2, 1);
      }
      if (groups > 2) {
        _tile_loadd(3, v + 32 * kStep, kStep * 2);
        _tile_dpbf16ps(6, 3, 1);
        _tile_loadd(0, v + 48 * kStep, kStep * 2);
        _tile_dpbf16ps(7, 0, 1);
      }
      if (!resident_) store_sums(d);
    }
#endif
  }

  // Sums of dims [d, d + 64) between memory and tiles 4-7 (head_dim is a multiple of 32).
  // Tile numbers are immediates (the intrinsics paste them into the instruction): one
  // function per direction.
  void load_sums(int64_t d) {
#if defined(LOOM_AMX_TILES)
    _tile_loadd(4, w_.sums[d], 64);
    _tile_loadd(5, w_.sums[d + 16], 64);
    if (d + 32 >= s_.dim) return;
    _tile_loadd(6, w_.sums[d + 32], 64);
    _tile_loadd(7, w_.sums[d + 48], 64);
#endif
    (void)d;
  }
  void store_sums(int64_t d) {
#if defined(LOOM_AMX_TILES)
    _tile_stored(4, w_.sums[d], 64);
    _tile_stored(5, w_.sums[d + 16], 64);
    if (d + 32 >= s_.dim) return;
    _tile_stored(6, w_.sums[d + 32], 64);
    _tile_stored(7, w_.sums[d + 48], 64);
#endif
    (void)d;
  }

  // Row j of the output: column j of O^T over the total, 16 dims at a time (16 x 16 blocks
  // of O^T transposed in registers).
  void write_out(uint16_t* out) const {
    alignas(64) float inverse[16];
    _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.f), total_));
    for (int64_t d = 0; d < s_.dim; d += 16) {
      __m512 block[16];
      for (int i = 0; i < 16; ++i) block[i] = _mm512_load_ps(w_.sums[d + i]);
      transpose16(block);
      for (int64_t j = 0; j < rows_; ++j) {
        uint16_t* dst = out + ((c_.q_start + row0_ + j) * s_.num_heads + head_) * s_.dim + d;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                            to_bf16(_mm512_mul_ps(block[j], _mm512_set1_ps(inverse[j]))));
      }
    }
  }

  const Chunk& c_;
  const Shape& s_;
  Scratch& w_;
  const int64_t head_, row0_, rows_, first_;  // first_: the position of row 0
  const bool resident_;  // the sums stay in tiles 4-7 between steps
  __m512 max_, total_;  // per query: the reference max of its weights, their sum
};

struct Task {
  int64_t chunk, head, row0, keys;  // keys: its cost, for the order
};

void prefill(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
             const uint16_t* v_cache, std::vector<Chunk>& chunks, const Shape& s, uint16_t* out,
             int threads) {
  std::vector<Task> tasks;
  std::vector<std::pair<int64_t, int64_t>> value_groups;  // (chunk, first key)
  for (int64_t i = 0; i < int64_t(chunks.size()); ++i) {
    const Chunk& c = chunks[i];
    for (int64_t row0 = 0; row0 < c.query_len; row0 += kRows)
      for (int64_t h = 0; h < s.num_heads; ++h)
        tasks.push_back({i, h, row0, c.first_pos() + std::min<int64_t>(row0 + kRows, c.query_len)});
    for (int64_t key = 0; key < c.seq_len; key += kStep) value_groups.push_back({i, key});
  }
  // The longest first, so that the last tasks to start are short ones.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.keys > b.keys; });
  const int64_t groups = int64_t(value_groups.size());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < groups * s.num_kv_heads; ++item) {
      const auto [i, key] = value_groups[item / s.num_kv_heads];
      lay_out_values(v_cache, chunks[i], item % s.num_kv_heads, key, s);
    }
    Scratch scratch;
#if defined(LOOM_AMX_TILES)
    if (s.tiles) load_tile_shapes();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < int64_t(tasks.size()); ++t) {
      const Task& task = tasks[t];
      RowBlock(q, q_stride, chunks[task.chunk], task.head, task.row0, s, scratch)
          .attend(k_cache, out);
    }
#if defined(LOOM_AMX_TILES)
    if (s.tiles) _tile_release();
#endif
  }
}

inline bool tiles_permitted() {
#if defined(LOOM_AMX_TILES)
  return amx_permitted();
#else
  return false;
#endif
}

#endif  // LOOM_PREFILL_KERNEL

}  // namespace

// 2: the products on AMX tiles or in vectors; 1: in vectors only (AVX512-BF16); 0: no kernel.
extern "C" int loom_prefill_kind() {
#if defined(LOOM_PREFILL_KERNEL)
  return tiles_permitted() ? 2 : 1;
#else
  return 0;
#endif
}

// Chunk i: rows [q_starts[i], q_starts[i] + query_lens[i]) of q (bf16 [T, num_heads, dim],
// rows q_stride apart) at the end of a context of seq_lens[i] keys whose blocks are
// tables[i * table_stride ...]; out [T, num_heads, dim] gets those rows. `values_t`: scratch
// of at least sum_i(num_kv_heads * dim * seq_lens[i] rounded up to 32) bf16 values. `tiles`:
// the products on AMX tiles (loom_prefill_kind() 2), else in vectors.
extern "C" int loom_paged_prefill(const void* q, int64_t q_stride, const void* k_cache,
                                  const void* v_cache, const int64_t* tables,
                                  int64_t table_stride, const int64_t* q_starts,
                                  const int64_t* query_lens, const int64_t* seq_lens, int64_t n,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                                  int64_t dim, float scale, int64_t window, float softcap,
                                  void* values_t, int64_t values_t_elems, int tiles,
                                  void* out, int threads) {
#if defined(LOOM_PREFILL_KERNEL)
  if (tiles && !tiles_permitted()) return 1;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads || dim % 32 || dim > kMaxDim ||
      block_size % 16)
    return 2;
  const Shape shape{num_heads, num_kv_heads, block_size, dim, scale, window, softcap, tiles != 0};
  std::vector<Chunk> chunks;
  int64_t used = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (query_lens[i] < 1 || query_lens[i] > seq_lens[i]) return 3;
    chunks.push_back({q_starts[i], query_lens[i], seq_lens[i], tables + i * table_stride,
                      static_cast<uint16_t*>(values_t) + used});
    used += num_kv_heads * dim * chunks.back().padded_len();
  }
  if (used > values_t_elems) return 4;
  prefill(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(k_cache),
          static_cast<const uint16_t*>(v_cache), chunks, shape, static_cast<uint16_t*>(out),
          threads);
  return 0;
#else
  (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)tables, (void)table_stride;
  (void)q_starts, (void)query_lens, (void)seq_lens, (void)n, (void)num_heads;
  (void)num_kv_heads, (void)block_size, (void)dim, (void)scale, (void)window, (void)softcap;
  (void)values_t, (void)values_t_elems, (void)tiles, (void)out, (void)threads;
  return 1;
#endif
}
