#include "kernels/attention.h"

#include <algorithm>
#include <cmath>

#include "kernels/dot.h"

namespace r3::kernels {

namespace {

inline const float* v_row(const PagedHead& kv, int j) {
  return kv.v_base + (int64_t(kv.block_table[j / kv.block_size]) * kv.block_size + j % kv.block_size) * kv.kv_dim +
         kv.head_offset;
}

// Scores of the first n keys of one block (kt: [head_dim][block_size]).
inline void block_scores(const float* q, const float* kt, int hd, int bs, int n, float scale, float* s) {
#if defined(__AVX512F__)
  if (bs == 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < hd; ++d) acc = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_loadu_ps(kt + d * 16), acc);
    _mm512_mask_storeu_ps(s, __mmask16((1u << n) - 1), _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
    return;
  }
#endif
  for (int j = 0; j < n; ++j) {
    float acc = 0.f;
    for (int d = 0; d < hd; ++d) acc = std::fma(q[d], kt[d * bs + j], acc);
    s[j] = acc * scale;
  }
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
  const int bs = kv.block_size;
  float m = -INFINITY;
  for (int b = 0; b * bs <= pos; ++b) {
    const float* kt = kv.k_base + (int64_t(kv.block_table[b]) * kv.kv_dim + kv.head_offset) * bs;
    const int n = std::min(bs, pos + 1 - b * bs);
    block_scores(q, kt, hd, bs, n, scale, scores + b * bs);
    for (int j = 0; j < n; ++j) m = std::max(m, scores[b * bs + j]);
  }
  std::fill(out, out + hd, 0.f);
  float sum = 0.f;
#if defined(__AVX512F__)
  if (hd % 16 == 0 && hd <= 128) {
    // The same per-d fma sequence as axpy, with the output kept in registers across keys.
    __m512 acc[8];
    const int nv = hd / 16;
    for (int i = 0; i < nv; ++i) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j <= pos; ++j) {
      const float w = std::exp(scores[j] - m);
      sum += w;
      const __m512 wv = _mm512_set1_ps(w);
      const float* vj = v_row(kv, j);
      for (int i = 0; i < nv; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(vj + 16 * i), acc[i]);
    }
    for (int i = 0; i < nv; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
  } else
#endif
  for (int j = 0; j <= pos; ++j) {
    const float w = std::exp(scores[j] - m);
    sum += w;
    axpy(w, v_row(kv, j), out, hd);
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < hd; ++d) out[d] *= inv;
}

}  // namespace r3::kernels
