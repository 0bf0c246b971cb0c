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

// Scores of the first n keys become their softmax numerators exp(s - max); returns their sum
// (taken in key order).
float softmax_weights(float* s, int n) {
  float m = -INFINITY;
  for (int j = 0; j < n; ++j) m = std::max(m, s[j]);
  exp_below_max(s, n, m, 1.f, s);
  float sum = 0.f;
  for (int j = 0; j < n; ++j) sum += s[j];
  return sum;
}

// out[d] = fma(w[j], v_j[d], out[d]) for keys [from, to), in key order (the tail of a query
// whose group shared the keys before `from`).
void weighted_values_tail(const float* w, int from, int to, const PagedHead& kv, int hd, float* out) {
  for (int j = from; j < to; ++j) {
    const float* vj = v_row(kv, j);
    for (int d = 0; d < hd; ++d) out[d] = std::fma(w[j], vj[d], out[d]);
  }
}

#if defined(__AVX512F__)
// Scores of every block up to n_max for Q queries: each K vector loaded once feeds Q chains.
template <int Q>
void group_scores(const float* const* q, int hd, float scale, const PagedHead& kv, int n_max, float* s,
                  int stride) {
  for (int b = 0; b * 16 < n_max; ++b) {
    const float* kt = k_block(kv, b);
    __m512 acc[Q];
#pragma GCC unroll 4
    for (int i = 0; i < Q; ++i) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < hd; ++d) {
      const __m512 k = _mm512_loadu_ps(kt + d * 16);
#pragma GCC unroll 4
      for (int i = 0; i < Q; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), k, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < Q; ++i)
      _mm512_storeu_ps(s + size_t(i) * stride + b * 16, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
  }
}

// out[i][d] = sum_j w_i[j] * v_j[d] over keys [0, n_min) in key order for Q queries, each V
// row loaded once, Q x NV accumulators kept in registers across keys; outputs stored unscaled.
template <int NV, int Q>
void group_values(const float* w, int stride, int n_min, const PagedHead& kv, float* const* out) {
  __m512 acc[Q][NV];
#pragma GCC unroll 4
  for (int i = 0; i < Q; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const int bs = kv.block_size;
  for (int j0 = 0; j0 < n_min; j0 += bs) {
    const float* row = v_row(kv, j0);
    const int m = std::min(bs, n_min - j0);
    for (int j = j0; j < j0 + m; ++j, row += kv.kv_dim) {
      __m512 vv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_ps(row + 16 * v);
#pragma GCC unroll 4
      for (int i = 0; i < Q; ++i) {
        const __m512 wv = _mm512_set1_ps(w[size_t(i) * stride + j]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(wv, vv[v], acc[i][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < Q; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[i] + 16 * v, acc[i][v]);
}

template <int NV, int Q>
void attend_group_fixed(const float* const* q, const int* pos, int hd, float scale, const PagedHead& kv,
                        float* scores, int stride, float* const* out) {
  int n_min = pos[0] + 1, n_max = pos[0] + 1;
  for (int i = 1; i < Q; ++i) n_min = std::min(n_min, pos[i] + 1), n_max = std::max(n_max, pos[i] + 1);
  group_scores<Q>(q, hd, scale, kv, n_max, scores, stride);
  float sum[Q];
  for (int i = 0; i < Q; ++i) sum[i] = softmax_weights(scores + size_t(i) * stride, pos[i] + 1);
  group_values<NV, Q>(scores, stride, n_min, kv, out);
  for (int i = 0; i < Q; ++i) {
    weighted_values_tail(scores + size_t(i) * stride, n_min, pos[i] + 1, kv, hd, out[i]);
    const float inv = 1.f / sum[i];
    for (int d = 0; d < hd; ++d) out[i][d] *= inv;
  }
}

template <int NV>
void attend_group_nv(const float* const* q, const int* pos, int nq, int hd, float scale, const PagedHead& kv,
                     float* scores, int stride, float* const* out) {
  switch (nq) {
    case 1: attend_group_fixed<NV, 1>(q, pos, hd, scale, kv, scores, stride, out); break;
    case 2: attend_group_fixed<NV, 2>(q, pos, hd, scale, kv, scores, stride, out); break;
    case 3: attend_group_fixed<NV, 3>(q, pos, hd, scale, kv, scores, stride, out); break;
    default: attend_group_fixed<NV, 4>(q, pos, hd, scale, kv, scores, stride, out); break;
  }
}
#endif

}  // namespace

void attend_group(const float* const* q, const int* pos, int nq, int hd, float scale, const PagedHead& kv,
                  float* scores, int stride, float* const* out) {
#if defined(__AVX512F__)
  if (kv.block_size == 16 && nq >= 1 && nq <= kMaxGroup) {
    if (hd == 64) return attend_group_nv<4>(q, pos, nq, hd, scale, kv, scores, stride, out);
    if (hd == 128) return attend_group_nv<8>(q, pos, nq, hd, scale, kv, scores, stride, out);
  }
#endif
  for (int i = 0; i < nq; ++i) attend(q[i], hd, pos[i], scale, kv, scores + size_t(i) * stride, out[i]);
}

void attend(const float* q, int hd, int pos, float scale, const PagedHead& kv, float* scores, float* out) {
  const int n = pos + 1;
  scores_of(q, hd, pos, scale, kv, scores);
  const float sum = softmax_weights(scores, n);  // weights replace the scores
  bool done = false;
#if defined(__AVX512F__)
  if (hd % 16 == 0 && hd <= 128) {
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((hd == 16 * (I + 1) ? group_values<I + 1, 1>(scores, 0, n, kv, &out) : void()), ...);
    }(std::make_integer_sequence<int, 8>{});
    done = true;
  }
#endif
  if (!done) {
    std::fill(out, out + hd, 0.f);
    weighted_values_tail(scores, 0, n, kv, hd, out);
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < hd; ++d) out[d] *= inv;
}

}  // namespace r3::kernels
