#include "numerics.h"

#include "bf16_vectors.h"

namespace {

constexpr int64_t kParallelElems = 1 << 15;  // below this, one thread beats waking the rest

// One row of add_rms_norm. res == nullptr: y = norm(x). Else res = x + res (rounded to T, as
// an unfused add would store it) and y = norm(res). y may be x.
template <typename T>
void norm_row(const T* x, T* res, const T* weight, T* y, int64_t hidden, float eps) {
  const T* normed = res ? res : x;
  float squares = 0.f;
  if (res) {
    for (int64_t i = 0; i < hidden; ++i) store(res + i, to_float(x[i]) + to_float(res[i]));
  }
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) squares += to_float(normed[i]) * to_float(normed[i]);
  const float inv_rms = 1.f / std::sqrt(squares / float(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i)
    store(y + i, to_float(normed[i]) * inv_rms * to_float(weight[i]));
}

// y = silu(gate) * up over one row.
template <typename T>
void silu_row(const T* gate, const T* up, T* y, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float g = to_float(gate[i]);
    store(y + i, g / (1.f + fast_exp(-g)) * to_float(up[i]));
  }
}

// One token's heads (back to back at v), in place: v * c + rotate_half(v) * s, with
// rotate_half's sign folded into s ([-sin | sin]).
template <typename T>
void rotate_token(T* v, int64_t heads, int64_t dim, const T* c, const T* s) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h, v += dim) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float first = to_float(v[i]), second = to_float(v[i + half]);
      store(v + i, first * to_float(c[i]) + second * to_float(s[i]));
      store(v + i + half, second * to_float(c[i + half]) + first * to_float(s[i + half]));
    }
  }
}

#if defined(LOOM_BF16_VECTORS)
// bf16 rows in AVX-512 vectors: the templates' math with hardware rounding to bf16, and
// SiLU's exponential only as precise as a bf16 result needs. At 2,048 rows (Zen 4):
// SiLU-and-multiply 2x faster than the template's, the norms 1.6x, RoPE 3x.
template <>
void norm_row(const uint16_t* x, uint16_t* res, const uint16_t* weight, uint16_t* y,
              int64_t hidden, float eps) {
  const uint16_t* normed = res ? res : x;
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    const __mmask16 live = lanes_below(hidden - i);
    __m512 v = load_bf16(x + i, live);
    if (res) {
      const __m256i sum = to_bf16(_mm512_add_ps(v, load_bf16(res + i, live)));
      _mm256_mask_storeu_epi16(res + i, live, sum);
      v = widen_bf16(sum);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv_rms =
      _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / float(hidden) + eps));
  for (int64_t i = 0; i < hidden; i += 16) {
    const __mmask16 live = lanes_below(hidden - i);
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(load_bf16(normed + i, live), inv_rms),
                                   load_bf16(weight + i, live));
    _mm256_mask_storeu_epi16(y + i, live, to_bf16(v));
  }
}

template <>
void silu_row(const uint16_t* gate, const uint16_t* up, uint16_t* y, int64_t width) {
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 live = lanes_below(width - i);
    const __m512 g = load_bf16(gate + i, live);
    // g / (1 + e^-g): 2^t to 7.5e-5 (the product is rounded to bf16, a 4e-3 step); where
    // e^-g is inf, g / inf = -0 as it should.
    const __m512 e = exp2_16(_mm512_mul_ps(g, _mm512_set1_ps(-kLog2e)));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm256_mask_storeu_epi16(y + i, live, to_bf16(_mm512_mul_ps(silu, load_bf16(up + i, live))));
  }
}

template <>
void rotate_token(uint16_t* v, int64_t heads, int64_t dim, const uint16_t* c,
                  const uint16_t* s) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += 16) {  // the token's cos and sin once for all its heads
    const __mmask16 live = lanes_below(half - i);
    const __m512 c1 = load_bf16(c + i, live), s1 = load_bf16(s + i, live);
    const __m512 c2 = load_bf16(c + i + half, live), s2 = load_bf16(s + i + half, live);
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* head = v + h * dim;
      const __m512 first = load_bf16(head + i, live), second = load_bf16(head + i + half, live);
      _mm256_mask_storeu_epi16(head + i, live,
                               to_bf16(_mm512_fmadd_ps(first, c1, _mm512_mul_ps(second, s1))));
      _mm256_mask_storeu_epi16(head + i + half, live,
                               to_bf16(_mm512_fmadd_ps(second, c2, _mm512_mul_ps(first, s2))));
    }
  }
}
#endif

// residual == nullptr: out = norm(src). Else residual = src + residual and out = norm(residual).
template <typename T>
void add_rms_norm(const T* src, T* residual, const T* weight, T* out, int64_t rows,
                  int64_t hidden, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * hidden >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r)
    norm_row(src + r * hidden, residual ? residual + r * hidden : nullptr, weight,
             out + r * hidden, hidden, eps);
}

// gate_up rows are [gate (width) | up (width)]; out rows are silu(gate) * up.
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r)
    silu_row(gate_up + r * 2 * width, gate_up + r * 2 * width + width, out + r * width, width);
}

// In place on x [tokens, heads, dim] (rows `row_stride` apart); cos, signed_sin [tokens, dim].
template <typename T>
void rotary(T* x, int64_t row_stride, int64_t tokens, int64_t heads, int64_t dim,
            const T* cos, const T* signed_sin, int threads) {
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= kParallelElems)
  for (int64_t t = 0; t < tokens; ++t)
    rotate_token(x + t * row_stride, heads, dim, cos + t * dim, signed_sin + t * dim);
}

}  // namespace

extern "C" void loom_rotary(int is_bf16, void* x, int64_t row_stride, int64_t tokens,
                            int64_t heads, int64_t dim, const void* cos, const void* signed_sin,
                            int threads) {
  if (is_bf16)
    rotary(static_cast<uint16_t*>(x), row_stride, tokens, heads, dim,
           static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(signed_sin), threads);
  else
    rotary(static_cast<float*>(x), row_stride, tokens, heads, dim,
           static_cast<const float*>(cos), static_cast<const float*>(signed_sin), threads);
}

extern "C" void loom_add_rms_norm(int is_bf16, const void* src, void* residual,
                                  const void* weight, void* out, int64_t rows, int64_t hidden,
                                  float eps, int threads) {
  if (is_bf16)
    add_rms_norm(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows,
                 hidden, eps, threads);
  else
    add_rms_norm(static_cast<const float*>(src), static_cast<float*>(residual),
                 static_cast<const float*>(weight), static_cast<float*>(out), rows, hidden, eps,
                 threads);
}

extern "C" void loom_silu_and_mul(int is_bf16, const void* gate_up, void* out, int64_t rows,
                                  int64_t width, int threads) {
  if (is_bf16)
    silu_and_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows,
                 width, threads);
  else
    silu_and_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, width,
                 threads);
}
