// Latent attention (attention_latent.h), compiled once per instruction set (isa.h).
#include "kernels/attention_latent.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "kernels/isa_entry_points.h"

// Compiled for this file's instruction set from here on (isa.h).
// clang-format off
#include "kernels/isa_begin.h"
#include "kernels/exp.h"
#include "kernels/vec16.h"
// clang-format on

namespace r3::kernels {
inline namespace R3_ISA_NS {

namespace {

template <typename KvT>
inline const KvT* latent_row(const PagedLatent<KvT>& cache, int j) {
  const int bs = cache.block_size;
  return cache.base + (int64_t(cache.block_table[j / bs]) * bs + j % bs) * int64_t(cache.width);
}

// One head's scores of keys 0..n-1, as the contract reads (the portable path).
template <typename KvT>
void head_scores(const float* q, int n, float scale, const PagedLatent<KvT>& cache, float* s) {
  for (int j = 0; j < n; ++j) {
    const KvT* r = latent_row(cache, j);
    float acc = 0.f;
    for (int d = 0; d < cache.width; ++d) acc = std::fma(q[d], widen(r[d]), acc);
    s[j] = acc * scale;
  }
}

// out[d] = fma(w[j], v_j[d], out[d]) over keys 0..n-1 in key order, for d in [d0, value_width)
// (all of them on the portable path, what the vector passes leave on the others).
template <typename KvT>
void weighted_values_from(int d0, const float* w, int n, int value_width,
                          const PagedLatent<KvT>& cache, float* out) {
  if (d0 >= value_width) return;
  std::fill(out + d0, out + value_width, 0.f);
  for (int j = 0; j < n; ++j) {
    const KvT* r = latent_row(cache, j);
    for (int d = d0; d < value_width; ++d) out[d] = std::fma(w[j], widen(r[d]), out[d]);
  }
}

#if defined(R3_VEC16)
// Scores of keys [j, j + K) for the heads in q_lanes' lanes (q_lanes: [width][16], head per
// lane): K independent fma chains, each row element broadcast once for all heads. Lane i of the
// result goes to s + i * stride.
template <int K, typename KvT>
inline void lane_scores(const float* q_lanes, int j, int heads, float scale,
                        const PagedLatent<KvT>& cache, float* s, int stride) {
  const KvT* r[K];
  Vec16 acc[K];
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) r[k] = latent_row(cache, j + k), acc[k] = Vec16::zero();
  for (int d = 0; d < cache.width; ++d) {
    const Vec16 qd = Vec16::load(q_lanes + size_t(d) * kLatentHeads);
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) acc[k] = fmadd(qd, Vec16::set1(widen(r[k][d])), acc[k]);
  }
  alignas(64) float lanes[kLatentHeads];
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    (acc[k] * Vec16::set1(scale)).store(lanes);
    for (int i = 0; i < heads; ++i) s[size_t(i) * stride + j + k] = lanes[i];
  }
}

// out[d] = fma(w[j], v_j[d], out[d]) over keys 0..n-1 in key order, 8 vectors of d at a time.
template <typename KvT>
void weighted_values(const float* w, int n, int value_width, const PagedLatent<KvT>& cache,
                     float* out) {
  int d0 = 0;
  for (; d0 + 128 <= value_width; d0 += 128) {
    Vec16 acc[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = Vec16::zero();
    for (int j = 0; j < n; ++j) {
      const KvT* r = latent_row(cache, j) + d0;
      const Vec16 wj = Vec16::set1(w[j]);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] = fmadd(wj, Vec16::load(r + 16 * c), acc[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c].store(out + d0 + 16 * c);
  }
  weighted_values_from(d0, w, n, value_width, cache, out);
}
#else
template <typename KvT>
void weighted_values(const float* w, int n, int value_width, const PagedLatent<KvT>& cache,
                     float* out) {
  weighted_values_from(0, w, n, value_width, cache, out);
}
#endif

}  // namespace

template <typename KvT>
void attend_latent_heads(const float* q, int h0, int h1, int value_width, int pos, float scale,
                         const PagedLatent<KvT>& cache, float* scores, int score_stride, float* out,
                         size_t out_stride) {
  const int n = pos + 1, heads = h1 - h0, w = cache.width;
#if defined(R3_VEC16)
  thread_local std::vector<float>
      q_lanes;  // [width][16]: head h0 + i in lane i, zero past the last
  q_lanes.assign(size_t(w) * kLatentHeads, 0.f);
  for (int i = 0; i < heads; ++i)
    for (int d = 0; d < w; ++d)
      q_lanes[size_t(d) * kLatentHeads + size_t(i)] = q[size_t(h0 + i) * size_t(w) + size_t(d)];
  int j = 0;
  for (; j + 8 <= n; j += 8)
    lane_scores<8>(q_lanes.data(), j, heads, scale, cache, scores, score_stride);
  for (; j < n; ++j) lane_scores<1>(q_lanes.data(), j, heads, scale, cache, scores, score_stride);
#else
  for (int i = 0; i < heads; ++i)
    head_scores(q + size_t(h0 + i) * size_t(w), n, scale, cache,
                scores + size_t(i) * size_t(score_stride));
#endif
  for (int i = 0; i < heads; ++i) {
    float* s = scores + size_t(i) * size_t(score_stride);
    const float m = *std::max_element(s, s + n);
    exp_below_max(s, n, m, 1.f, s);
    float sum = 0.f;
    for (int k = 0; k < n; ++k) sum += s[k];
    float* o = out + size_t(h0 + i) * out_stride;
    weighted_values(s, n, value_width, cache, o);
    const float inv = 1.f / sum;
    for (int d = 0; d < value_width; ++d) o[d] *= inv;
  }
}

template void attend_latent_heads(const float*, int, int, int, int, float,
                                  const PagedLatent<float>&, float*, int, float*, size_t);
template void attend_latent_heads(const float*, int, int, int, int, float,
                                  const PagedLatent<uint16_t>&, float*, int, float*, size_t);

}  // namespace R3_ISA_NS
}  // namespace r3::kernels

#include "kernels/isa_end.h"
