// Sampling over a step's logits (fp32 or bf16 as the output projection left them, or as
// edits left them), no fp32 copy of the rows. Greedy: each row's first index of its largest
// value, one pass.
//
// Random: one row per OpenMP iteration, no noise per token: each row draws one uniform u
// (from the caller, so seeds stay the caller's) and takes the token where u times the kept
// mass falls in the cumulative sum of the kept weights (inverse CDF).
//
// A row's weights are w = exp((logit - max) / T), so the largest is 1 and a float's bits
// order the weights as their values. min_p keeps w >= min_p (p / p_max = w). top_k and top_p
// need the largest weights in order: only the weights above a floor that leaves out none of
// them are sorted (larger weight first, then lower index). top_k applies before top_p, and top_p
// keeps the smallest prefix whose mass reaches top_p of what is left (the weight crossing it
// kept), as the torch path in engine/sampling/sampler.py does. T <= 0 (greedy) takes the
// row's first maximum.
#include "numerics.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
int64_t first_max_scalar(const T* row, int64_t begin, int64_t end, float& best) {
  int64_t index = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float value = to_float(row[i]);
    if (index < 0 || value > best) best = value, index = i;
  }
  return index;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Each lane keeps its first maximum; across lanes the largest value wins, ties to the
// smallest index: the row's first maximum.
template <typename T>
int64_t first_max(const T* row, int64_t width) {
  const int64_t vectorized = width / 16 * 16;
  float best = 0.f;
  if (vectorized == 0) return first_max_scalar(row, 0, width, best);
  __m512 best_values = load16(row);
  __m512i best_indices = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i indices = best_indices;
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 16; i < vectorized; i += 16) {
    indices = _mm512_add_epi32(indices, step);
    const __m512 values = load16(row + i);
    const __mmask16 larger = _mm512_cmp_ps_mask(values, best_values, _CMP_GT_OQ);
    best_values = _mm512_mask_blend_ps(larger, best_values, values);
    best_indices = _mm512_mask_blend_epi32(larger, best_indices, indices);
  }
  best = _mm512_reduce_max_ps(best_values);
  const __mmask16 at_best = _mm512_cmp_ps_mask(best_values, _mm512_set1_ps(best), _CMP_EQ_OQ);
  int64_t index = _mm512_mask_reduce_min_epi32(at_best, best_indices);
  float tail_best = best;
  const int64_t tail = first_max_scalar(row, vectorized, width, tail_best);
  return tail >= 0 && tail_best > best ? tail : index;
}
#else
template <typename T>
int64_t first_max(const T* row, int64_t width) {
  float best = 0.f;
  return first_max_scalar(row, 0, width, best);
}
#endif

template <typename T>
void argmax_rows(const T* logits, int64_t rows, int64_t width, int64_t stride, int64_t* out,
                 int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = first_max(logits + r * stride, width);
}

}  // namespace

extern "C" void loom_argmax_rows(int is_bf16, const void* logits, int64_t rows, int64_t width,
                                 int64_t stride, int64_t* out, int threads) {
  if (is_bf16)
    argmax_rows(static_cast<const uint16_t*>(logits), rows, width, stride, out, threads);
  else
    argmax_rows(static_cast<const float*>(logits), rows, width, stride, out, threads);
}

namespace {

struct Params {
  float temperature, top_p, min_p;
  int64_t top_k;
  double uniform;  // in [0, 1)
};

struct Weighted {
  float weight;
  int64_t index;
};

constexpr float kFirstFloor = 0x1p-5f, kFloorStep = 0x1p-5f, kLastFloor = 0x1p-120f;
constexpr int64_t kWalkBlock = 256;  // the inverse CDF walks sums of this many weights first
constexpr float kLowestExponent = -87.f;  // below: weight 0 (fast_exp's clamp)

// w[i] = exp((row[i] - max) / T), 0 below min_p's floor, and their sum; returns the largest
// logit's index.
template <typename T>
int64_t weights_of(const T* row, int64_t width, const Params& p, float* w, double& total) {
  const int64_t argmax = first_max(row, width);
  const float best = to_float(row[argmax]);
  const float inv_t = 1.f / p.temperature;
  const float floor = std::max(p.min_p > 0.f ? std::log(p.min_p) : -INFINITY, kLowestExponent);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) {
    const float x = (to_float(row[i]) - best) * inv_t;
    const float e = fast_exp(x);
    w[i] = x < floor ? 0.f : e;
    sum += w[i];
  }
  total = sum;
  return argmax;
}

// The token where u times the total falls in the cumulative weights, walked in index order.
int64_t walk_all(const float* w, int64_t width, double uniform, std::vector<double>& sums) {
  const int64_t blocks = (width + kWalkBlock - 1) / kWalkBlock;
  sums.resize(blocks);
  double total = 0.;
  for (int64_t b = 0; b < blocks; ++b) {
    float sum = 0.f;
    const int64_t end = std::min(width, (b + 1) * kWalkBlock);
#pragma omp simd reduction(+ : sum)
    for (int64_t i = b * kWalkBlock; i < end; ++i) sum += w[i];
    sums[b] = sum;
    total += sum;
  }
  const double target = uniform * total;
  double seen = 0.;
  int64_t last = -1;  // the last token of weight > 0 before the target: rounding's fallback
  for (int64_t b = 0; b < blocks; ++b) {
    if (seen + sums[b] <= target && b + 1 < blocks) {
      seen += sums[b];
      continue;
    }
    for (int64_t i = b * kWalkBlock; i < std::min(width, (b + 1) * kWalkBlock); ++i) {
      if (w[i] <= 0.f) continue;
      seen += w[i];
      last = i;
      if (seen > target) return i;
    }
  }
  return last;
}

// How many of w's entries are at least `floor` (and above 0); their indices go to `at`
// (room for width + 16).
int64_t collect_at_least(const float* w, int64_t width, float floor, int32_t* at) {
  int64_t count = 0, i = 0;
#if defined(__AVX512F__)
  // Compressed in a register and stored whole (a compressing store to memory is microcoded
  // on Zen 4); the lanes past the count are overwritten by the next store.
  const __m512 lowest = _mm512_set1_ps(std::max(floor, FLT_MIN));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i indices = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; i + 16 <= width; i += 16, indices = _mm512_add_epi32(indices, step)) {
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), lowest, _CMP_GE_OQ);
    _mm512_storeu_si512(at + count, _mm512_maskz_compress_epi32(keep, indices));
    count += _mm_popcnt_u32(keep);
  }
#endif
  for (; i < width; ++i) {  // branch-free: most weights are below the floor
    at[count] = int32_t(i);
    count += w[i] >= floor && w[i] > 0.f;
  }
  return count;
}

// The weights top_k and top_p keep, largest first (ties: lower index first). Candidates are
// the weights above a floor, lowered 32-fold until they hold the top k, or (top_p alone)
// top_p of the total mass: whatever lies below them cannot be kept.
void kept_in_order(const float* w, int64_t width, double total, const Params& p,
                   std::vector<Weighted>& out, std::vector<int32_t>& at) {
  const bool by_count = p.top_k > 0;
  const int64_t k = by_count ? p.top_k : width;
  const double wanted = p.top_p * total;  // top_p alone: of the whole mass
  if (int64_t(at.size()) < width + 16) at.resize(width + 16);
  out.clear();
  for (float floor = kFirstFloor;; floor = floor > kLastFloor ? floor * kFloorStep : 0.f) {
    const int64_t count = collect_at_least(w, width, floor, at.data());
    double mass = 0.;
    if (!by_count)
      for (int64_t j = 0; j < count; ++j) mass += w[at[j]];
    // floor 0: every weight (rounding left the mass short of top_p)
    if ((by_count ? count >= k : mass >= wanted) || floor == 0.f) {
      for (int64_t j = 0; j < count; ++j) out.push_back({w[at[j]], at[j]});
      break;
    }
  }
  const auto larger = [](const Weighted& a, const Weighted& b) {
    return a.weight > b.weight || (a.weight == b.weight && a.index < b.index);
  };
  if (int64_t(out.size()) > k) {
    std::nth_element(out.begin(), out.begin() + k, out.end(), larger);
    out.resize(k);
  }
  std::sort(out.begin(), out.end(), larger);
  if (p.top_p >= 1.f || out.empty()) return;
  double base = 0.;  // top_p of what top_k left
  for (const Weighted& item : out) base += item.weight;
  const double threshold = by_count ? p.top_p * base : wanted;
  double before = 0.;
  size_t kept = 0;
  while (kept < out.size() && before < threshold) before += out[kept++].weight;
  out.resize(std::max<size_t>(kept, 1));
}

int64_t walk_kept(const std::vector<Weighted>& kept, double uniform) {
  double total = 0.;
  for (const Weighted& item : kept) total += item.weight;
  const double target = uniform * total;
  double seen = 0.;
  for (const Weighted& item : kept) {
    seen += item.weight;
    if (seen > target) return item.index;
  }
  return kept.back().index;
}

template <typename T>
int64_t sample_row(const T* row, int64_t width, const Params& p) {
  thread_local std::vector<float> w;
  thread_local std::vector<double> sums;
  thread_local std::vector<int32_t> at;
  thread_local std::vector<Weighted> kept;
  if (p.temperature <= 0.f || p.top_k == 1) return first_max(row, width);
  w.resize(width);
  double total = 0.;
  const int64_t argmax = weights_of(row, width, p, w.data(), total);
  if (!(to_float(row[argmax]) > -INFINITY)) return argmax;  // nothing to weigh
  const bool filters = (p.top_k > 0 && p.top_k < width) || p.top_p < 1.f;
  if (!filters) {
    const int64_t token = walk_all(w.data(), width, p.uniform, sums);
    return token < 0 ? argmax : token;
  }
  kept_in_order(w.data(), width, total, p, kept, at);
  return kept.empty() ? argmax : walk_kept(kept, p.uniform);
}

template <typename T>
void sample_rows(const T* logits, int64_t rows, int64_t width, int64_t stride,
                 const float* temperatures, const int64_t* top_ks, const float* top_ps,
                 const float* min_ps, const double* uniforms, int64_t* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r)
    out[r] = sample_row(logits + r * stride, width,
                        Params{temperatures[r], top_ps[r], min_ps[r], top_ks[r], uniforms[r]});
}

}  // namespace

// out[r]: row r's token, drawn with uniforms[r] (T <= 0: its first maximum).
extern "C" void loom_sample_rows(int is_bf16, const void* logits, int64_t rows, int64_t width,
                                 int64_t stride, const float* temperatures,
                                 const int64_t* top_ks, const float* top_ps,
                                 const float* min_ps, const double* uniforms, int64_t* out,
                                 int threads) {
  if (is_bf16)
    sample_rows(static_cast<const uint16_t*>(logits), rows, width, stride, temperatures, top_ks,
                top_ps, min_ps, uniforms, out, threads);
  else
    sample_rows(static_cast<const float*>(logits), rows, width, stride, temperatures, top_ks,
                top_ps, min_ps, uniforms, out, threads);
}
