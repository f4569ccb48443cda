// Greedy sampling over a step's raw logits (fp32 or bf16 as the output projection left
// them): each row's first index of its largest value, one pass, no fp32 copy of the rows.
#include "numerics.h"

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
