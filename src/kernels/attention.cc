#include "kernels/attention.h"

#include <algorithm>
#include <cmath>

#include "kernels/dot.h"

namespace r3::kernels {

namespace {

inline const float* row(const float* base, const PagedHead& kv, int j) {
  return base + (int64_t(kv.block_table[j / kv.block_size]) * kv.block_size + j % kv.block_size) * kv.kv_dim +
         kv.head_offset;
}

// q . k in the dot.h f32 order (lane i % 16, fma, fixed tree).
inline float qk(const float* q, const float* k, int hd) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= hd; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(k + i), _mm512_loadu_ps(q + i), acc);
  if (i < hd) {
    const __mmask16 m = __mmask16((1u << (hd - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, k + i), _mm512_maskz_loadu_ps(m, q + i), acc);
  }
  return reduce512(acc);
#else
  return dot_f32_portable(k, q, hd);
#endif
}

// out[d] = fma(w, v[d], out[d]): per d the same operation whatever the vector width.
inline void axpy(float w, const float* v, float* out, int hd) {
  int d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; d + 16 <= hd; d += 16)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(wv, _mm512_loadu_ps(v + d), _mm512_loadu_ps(out + d)));
#endif
  for (; d < hd; ++d) out[d] = std::fma(w, v[d], out[d]);
}

}  // namespace

void attend(const float* q, int hd, int pos, float scale, const PagedHead& kv, float* scores, float* out) {
  float m = -INFINITY;
  for (int j = 0; j <= pos; ++j) {
    scores[j] = qk(q, row(kv.k_base, kv, j), hd) * scale;
    m = std::max(m, scores[j]);
  }
  std::fill(out, out + hd, 0.f);
  float sum = 0.f;
  for (int j = 0; j <= pos; ++j) {
    const float w = std::exp(scores[j] - m);
    sum += w;
    axpy(w, row(kv.v_base, kv, j), out, hd);
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < hd; ++d) out[d] *= inv;
}

}  // namespace r3::kernels
