#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "kernels/dot.h"
#include "kernels/exp.h"

namespace r3::kernels {

namespace {

inline const float* v_row(const PagedHead& kv, int j) {
  return kv.v_base + (int64_t(kv.block_table[j / kv.block_size]) * kv.block_size + j % kv.block_size) * kv.kv_dim +
         kv.head_offset;
}

inline const float* k_block(const PagedHead& kv, int b) {
  return kv.k_base + (int64_t(kv.block_table[b]) * kv.kv_dim + kv.head_offset) * kv.block_size;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same operations in the same order as the scalar version.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_GE_OQ), y);
}

// Scores of B full blocks of 16 keys at once (B independent fma chains over d).
template <int B>
inline void full_block_scores(const float* q, const PagedHead& kv, int b0, int hd, float scale, float* s) {
  const float* kt[B];
  __m512 acc[B];
#pragma GCC unroll 8
  for (int i = 0; i < B; ++i) kt[i] = k_block(kv, b0 + i), acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    const __m512 qd = _mm512_set1_ps(q[d]);
#pragma GCC unroll 8
    for (int i = 0; i < B; ++i) acc[i] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kt[i] + d * 16), acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < B; ++i) _mm512_storeu_ps(s + (b0 + i) * 16, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
}

// out[d] = sum_j w[j] * v_j[d] in key order, NV vectors of 16 kept in registers across keys.
template <int NV>
inline void weighted_values(const float* w, int n, const PagedHead& kv, float* out) {
  __m512 acc[NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) acc[i] = _mm512_setzero_ps();
  const int bs = kv.block_size;
  for (int j0 = 0; j0 < n; j0 += bs) {
    const float* v = v_row(kv, j0);  // a block's rows are kv_dim apart
    const int m = std::min(bs, n - j0);
    for (int j = 0; j < m; ++j, v += kv.kv_dim) {
      const __m512 wv = _mm512_set1_ps(w[j0 + j]);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(v + 16 * i), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
}
#endif

// Scores of keys 0..pos into s (the same per-score order on every path).
void scores_of(const float* q, int hd, int pos, float scale, const PagedHead& kv, float* s) {
  const int bs = kv.block_size, n = pos + 1;
  int b = 0;
#if defined(__AVX512F__)
  if (bs == 16) {
    const int full = n / 16;
    for (; b + 8 <= full; b += 8) full_block_scores<8>(q, kv, b, hd, scale, s);
    for (; b + 2 <= full; b += 2) full_block_scores<2>(q, kv, b, hd, scale, s);
    for (; b < full; ++b) full_block_scores<1>(q, kv, b, hd, scale, s);
  }
#endif
  for (; b * bs < n; ++b) {
    const float* kt = k_block(kv, b);
    const int m = std::min(bs, n - b * bs);
    for (int j = 0; j < m; ++j) {
      float acc = 0.f;
      for (int d = 0; d < hd; ++d) acc = std::fma(q[d], kt[d * bs + j], acc);
      s[b * bs + j] = acc * scale;
    }
  }
}

}  // namespace

void attend(const float* q, int hd, int pos, float scale, const PagedHead& kv, float* scores, float* out) {
  const int n = pos + 1;
  scores_of(q, hd, pos, scale, kv, scores);
  float m = -INFINITY;
  for (int j = 0; j < n; ++j) m = std::max(m, scores[j]);
  // Weights replace the scores; their sum is taken in key order.
  int j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(scores + j, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), _mm512_set1_ps(m))));
#endif
  for (; j < n; ++j) scores[j] = exp_nonpositive(scores[j] - m);
  float sum = 0.f;
  for (j = 0; j < n; ++j) sum += scores[j];
  bool done = false;
#if defined(__AVX512F__)
  if (hd % 16 == 0 && hd <= 128) {
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((hd == 16 * (I + 1) ? weighted_values<I + 1>(scores, n, kv, out) : void()), ...);
    }(std::make_integer_sequence<int, 8>{});
    done = true;
  }
#endif
  if (!done) {
    std::fill(out, out + hd, 0.f);
    for (j = 0; j < n; ++j) {
      const float w = scores[j];
      const float* vj = v_row(kv, j);
      for (int d = 0; d < hd; ++d) out[d] = std::fma(w, vj[d], out[d]);
    }
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < hd; ++d) out[d] *= inv;
}

}  // namespace r3::kernels
