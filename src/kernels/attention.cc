// Paged attention (attention.h), compiled once per instruction set (isa.h).
#include "kernels/attention.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "kernels/isa_entry_points.h"

// Compiled for this file's instruction set from here on (isa.h).
// clang-format off
#include "kernels/isa_begin.h"
#include "kernels/dot.h"
#include "kernels/exp.h"
#include "kernels/vec16.h"
// clang-format on

namespace r3::kernels {
inline namespace R3_ISA_NS {

namespace {

// Key j's values: head_dim elements, contiguous; the block's later slots follow at head_dim
// strides.
template <typename KvT>
inline const KvT* v_row(const PagedHead<KvT>& kv, int j, int hd) {
  return kv.v_base +
         (int64_t(kv.block_table[j / kv.block_size]) * kv.kv_dim + kv.head_offset) * kv.block_size +
         int64_t(j % kv.block_size) * hd;
}

template <typename KvT>
inline const KvT* k_block(const PagedHead<KvT>& kv, int b) {
  return kv.k_base + (int64_t(kv.block_table[b]) * kv.kv_dim + kv.head_offset) * kv.block_size;
}

// Scores of keys first..pos into s[first..pos], one key at a time (any block size; the vector
// path's lanes do the same operations).
template <typename KvT>
void scores_portable(const float* q, int hd, int first, int pos, float scale,
                     const PagedHead<KvT>& kv, float* s) {
  const int bs = kv.block_size, n = pos + 1;
  for (int b = first / bs; b * bs < n; ++b) {
    const KvT* kt = k_block(kv, b);
    const int m = std::min(bs, n - b * bs);
    for (int j = b == first / bs ? first % bs : 0; j < m; ++j) {
      float acc = 0.f;
      for (int d = 0; d < hd; ++d) acc = std::fma(q[d], widen(kt[d * bs + j]), acc);
      s[b * bs + j] = acc * scale;
    }
  }
}

// The largest of m and s[0..n): exact in any order, so taken 16 lanes at a time.
inline float max_of(const float* s, int n, float m) {
  int j = 0;
#if defined(R3_VEC16)
  Vec16 mv = Vec16::set1(m);
  for (; j + 16 <= n; j += 16) {
    const Vec16 x = Vec16::load(s + j);
    mv = select_ge(x, mv, x, mv);
  }
  float lanes[16];
  mv.store(lanes);
  for (float x : lanes) m = std::max(m, x);
#endif
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// Scores of n keys become their softmax numerators exp(s - max); returns their sum, plus the
// sink's numerator last when the head has one (the max includes the sink). The sum adds w[j]
// into lane j % 16 in order, then dot.h's tree of the 16 lanes (a sum in key order is one
// dependent add per key, the slowest part of a prefill's softmax), in the same pass as the
// numerators: exp_below_max's values, without its division by a divisor of 1.
template <typename KvT>
float softmax_weights(float* s, int n, const PagedHead<KvT>& kv) {
  const float m = max_of(s, n, kv.has_sink ? kv.sink : -INFINITY);
  float lanes[16] = {0};
  int j = 0;
#if defined(R3_VEC16)
  const Vec16 mv = Vec16::set1(m);
  Vec16 acc = Vec16::zero();
  for (; j + 16 <= n; j += 16) {
    const Vec16 e = exp_nonpositive(Vec16::load(s + j) - mv);
    e.store(s + j);
    acc = acc + e;
  }
  acc.store(lanes);
#endif
  for (; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - m);
    lanes[j % 16] += s[j];
  }
  float sum = reduce_lanes16(lanes);
  if (kv.has_sink) {
    float e;
    exp_below_max(&kv.sink, 1, m, 1.f, &e);
    sum += e;
  }
  return sum;
}

// out[d] = fma(w[j], v_j[d], out[d]) for keys [from, to), in key order (the tail of a query
// whose group shared the keys before `from`).
template <typename KvT>
void weighted_values_tail(const float* w, int from, int to, const PagedHead<KvT>& kv, int hd,
                          float* out) {
  for (int j = from; j < to; ++j) {
    const KvT* vj = v_row(kv, j, hd);
    for (int d = 0; d < hd; ++d) out[d] = std::fma(w[j], widen(vj[d]), out[d]);
  }
}

#if defined(R3_VEC16)
// The vector path (AVX-512, or AVX2 as two halves: kernels/vec16.h), for block sizes that are
// multiples of 16: a block's keys are scored 16 at a time (a lane group).

// Blocks sit anywhere in the pool, so the hardware prefetcher restarts at every one: the loops
// request one head's K or V of a block (head_dim x block_size elements) a little ahead themselves,
// about 8 KiB of bf16 at head_dim 64.
inline int ahead_blocks(int block_size) { return std::max(1, 64 / block_size); }

template <typename KvT>
inline void prefetch_block(const KvT* p, int hd, int block_size) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t at = 0; at < size_t(hd) * size_t(block_size) * sizeof(KvT); at += 64)
    _mm_prefetch(c + at, _MM_HINT_T0);
}

// Scores of lane groups [g0, g0 + B) for Q queries (all 16 lanes, also past the last key of a
// partial block): each K vector loaded once feeds Q chains, and B groups at once give Q x B
// independent fma chains (one chain alone waits on fma latency). At each block's first group,
// prefetches the K block `ahead` further on or, past the last block, the values' first blocks.
template <int Q, int B, typename KvT>
inline void score_groups(const float* const* q, int hd, float scale, const PagedHead<KvT>& kv,
                         int g0, int blocks, int ahead, float* s, int stride) {
  const int bs = kv.block_size, per_block = bs / 16;
  const KvT* kt[B];
  Vec16 acc[B][Q];
#pragma GCC unroll 8
  for (int i = 0; i < B; ++i) {
    const int g = g0 + i, b = g / per_block;
    kt[i] = k_block(kv, b) + (g % per_block) * 16;
    if (g % per_block == 0) {
      if (b + ahead < blocks)
        prefetch_block(k_block(kv, b + ahead), hd, bs);
      else if (b + ahead - blocks < std::min(ahead, blocks))
        prefetch_block(v_row(kv, (b + ahead - blocks) * bs, hd), hd, bs);
    }
#pragma GCC unroll 8
    for (int j = 0; j < Q; ++j) acc[i][j] = Vec16::zero();
  }
  for (int d = 0; d < hd; ++d) {
#pragma GCC unroll 8
    for (int i = 0; i < B; ++i) {
      const Vec16 k = Vec16::load(kt[i] + d * bs);
#pragma GCC unroll 8
      for (int j = 0; j < Q; ++j) acc[i][j] = fmadd(Vec16::set1(q[j][d]), k, acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < B; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < Q; ++j)
      (acc[i][j] * Vec16::set1(scale)).store(s + size_t(j) * stride + (g0 + i) * 16);
}

// Independent fma chains score_groups keeps in flight: two fma ports of four cycles' latency
// need eight. AVX2's sixteen registers hold four (each Vec16 is two of them).
constexpr int kScoreChains = R3_ISA_AVX512 ? 8 : 4;

// Scores of keys first..n_max-1 (widened to whole lane groups) for Q queries, kScoreChains
// chains at a time where the groups allow.
template <int Q, typename KvT>
void group_scores(const float* const* q, int hd, float scale, const PagedHead<KvT>& kv, int first,
                  int n_max, float* s, int stride) {
  constexpr int B = Q >= kScoreChains ? 1 : kScoreChains / Q;
  const int groups = (n_max + 15) / 16, blocks = (n_max + kv.block_size - 1) / kv.block_size;
  const int ahead = ahead_blocks(kv.block_size);
  int g = first / 16;
  for (; g + B <= groups; g += B) score_groups<Q, B>(q, hd, scale, kv, g, blocks, ahead, s, stride);
  for (; g < groups; ++g) score_groups<Q, 1>(q, hd, scale, kv, g, blocks, ahead, s, stride);
}

// out[i][d] = sum_j w_i[j] * v_j[d] over keys [first, n_min) in key order for Q queries, each V
// row loaded once, Q x NV accumulators kept in registers across keys; outputs stored unscaled.
template <int NV, int Q, typename KvT>
void group_values(const float* w, int stride, int first, int n_min, const PagedHead<KvT>& kv,
                  float* const* out) {
  Vec16 acc[Q][NV];
#pragma GCC unroll 4
  for (int i = 0; i < Q; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[i][v] = Vec16::zero();
  const int bs = kv.block_size;
  for (int j0 = first; j0 < n_min; j0 = (j0 / bs + 1) * bs) {
    const KvT* row = v_row(kv, j0, 16 * NV);
    const int next =
        (j0 / bs + std::max(1, 32 / bs)) * bs;  // half as far as the scores: V is read faster
    if (next < n_min) prefetch_block(v_row(kv, next, 16 * NV), 16 * NV, bs);
    const int m = std::min(bs - j0 % bs, n_min - j0);
    for (int j = j0; j < j0 + m; ++j, row += 16 * NV) {
      Vec16 vv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) vv[v] = Vec16::load(row + 16 * v);
#pragma GCC unroll 4
      for (int i = 0; i < Q; ++i) {
        const Vec16 wv = Vec16::set1(w[size_t(i) * stride + j]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[i][v] = fmadd(wv, vv[v], acc[i][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < Q; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[i][v].store(out[i] + 16 * v);
}

// Queries that share one pass over the keys: the scores take one chain per query (a group's
// queries over one lane group), the values' accumulators are Q x head_dim, so they take fewer.
constexpr int kScoreQueries = kScoreChains;
constexpr int kValueQueries = 4;

// The weighted values of Q queries whose weights are in w (rows of `stride`), each over its own
// keys 0..pos[i]: the keys every query has in one pass, each query's remaining keys after it.
template <int NV, int Q, typename KvT>
void values_of(const float* w, int stride, const int* pos, int hd, const PagedHead<KvT>& kv,
               float* const* out) {
  int n_min = pos[0] + 1;
  for (int i = 1; i < Q; ++i) n_min = std::min(n_min, pos[i] + 1);
  group_values<NV, Q>(w, stride, 0, n_min, kv, out);
  for (int i = 0; i < Q; ++i)
    weighted_values_tail(w + size_t(i) * stride, n_min, pos[i] + 1, kv, hd, out[i]);
}

template <int NV, int Q, typename KvT>
void attend_group_fixed(const float* const* q, const int* pos, int hd, float scale,
                        const PagedHead<KvT>& kv, float* scores, int stride, float* const* out) {
  if constexpr (Q > kScoreQueries) {  // (the scores' group of this instruction set, then the rest)
    attend_group_fixed<NV, kScoreQueries>(q, pos, hd, scale, kv, scores, stride, out);
    attend_group_fixed<NV, Q - kScoreQueries>(q + kScoreQueries, pos + kScoreQueries, hd, scale, kv,
                                              scores + size_t(kScoreQueries) * stride, stride,
                                              out + kScoreQueries);
  } else {
    int n_max = pos[0] + 1;
    for (int i = 1; i < Q; ++i) n_max = std::max(n_max, pos[i] + 1);
    group_scores<Q>(q, hd, scale, kv, 0, n_max, scores, stride);
    float sum[Q];
    for (int i = 0; i < Q; ++i)
      sum[i] = softmax_weights(scores + size_t(i) * stride, pos[i] + 1, kv);
    constexpr int V = std::min(Q, kValueQueries);
    values_of<NV, V>(scores, stride, pos, hd, kv, out);
    if constexpr (Q > V)
      values_of<NV, Q - V>(scores + size_t(V) * stride, stride, pos + V, hd, kv, out + V);
    for (int i = 0; i < Q; ++i) {
      const float inv = 1.f / sum[i];
      for (int d = 0; d < hd; ++d) out[i][d] *= inv;
    }
  }
}

// Scores of N (query, lane group) pairs, each lane as score_groups computes it: N independent
// fma chains whatever heads or blocks the pairs come from.
template <int N, typename KvT>
inline void score_lanes(const float* const* q, const KvT* const* kt, int hd, int bs, float scale,
                        float* const* s) {
  Vec16 acc[N];
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i) acc[i] = Vec16::zero();
  for (int d = 0; d < hd; ++d)
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i)
      acc[i] = fmadd(Vec16::set1(q[i][d]), Vec16::load(kt[i] + d * bs), acc[i]);
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i) (acc[i] * Vec16::set1(scale)).store(s[i]);
}

// Collects (query, lane group) pairs and scores them four at a time.
template <typename KvT>
struct LaneBatch {
  int hd, bs;
  float scale;
  const float* q[4] = {};
  const KvT* k[4] = {};
  float* s[4] = {};
  int n = 0;
  void add(const float* qi, const KvT* ki, float* si) {
    q[n] = qi, k[n] = ki, s[n] = si;
    if (++n == 4) score_lanes<4>(q, k, hd, bs, scale, s), n = 0;
  }
  void flush() {
    if (n == 3) score_lanes<3>(q, k, hd, bs, scale, s);
    if (n == 2) score_lanes<2>(q, k, hd, bs, scale, s);
    if (n == 1) score_lanes<1>(q, k, hd, bs, scale, s);
    n = 0;
  }
};

inline void prefetch_run(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t at = 0; at < bytes; at += 64) _mm_prefetch(c + at, _MM_HINT_T0);
}

// acc[0..NV) += w[t] * (row t of v) for keys t = 0..m-1 in order (rows of 16 * NV values). With
// Spread the weights are loaded 16 at a time and spread from a register: a load per key feeds
// every fma of that key, and while one long stream of V comes from memory those loads (and the
// fma chains behind them) are what stall; without it, the one-load-per-key loop, which is faster
// where the V runs are short (a part of the heads) and the loads hit L1.
template <int NV, bool Spread, typename KvT>
inline void add_weighted_values(const float* w, int m, const KvT* v, Vec16* acc) {
  auto add_row = [&](Vec16 wt) {  // the next key's row
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) acc[i] = fmadd(wt, Vec16::load(v + 16 * i), acc[i]);
    v += 16 * NV;
  };
  if constexpr (!Spread) {
    for (int t = 0; t < m; ++t) add_row(Vec16::set1(w[t]));
    return;
  }
  for (int c = 0; c < m; c += 16) {
    const Vec16 w16 = Vec16::load(w + c);
    if (m - c >= 16) {
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) add_row(broadcast_lane(w16, t));
    } else {
      for (int t = 0; t < m - c; ++t) add_row(broadcast_lane(w16, t));
    }
  }
}

// attend_heads for head_dim 16 * NV: pass 1 scores every head block by block, pass 2 turns each
// head's scores into weights and copies them block-major (a block's weights of every head in one
// run, so pass 3 reads one stream, not one per head), pass 3 accumulates values block by block
// (each head's accumulators go through memory between blocks: fp32 stores are exact, so the sums
// are group_values'). A block's K (or V) of the heads' kv heads is one run. Pass 1 prefetches
// the run `ahead` blocks on, and in its last blocks the first V runs; pass 3 prefetches only a
// run that does not follow the one before it in memory: the hardware prefetcher streams
// adjacent runs (a request's blocks are mostly allocated in order), and a burst of software
// prefetches in that stream held the loads behind it.
template <int NV, typename KvT>
void attend_heads_vec(const float* q, int h0, int h1, int group, int pos, float scale,
                      const PagedHead<KvT>& kv, const float* sinks, float* scores, int stride,
                      float* out) {
  constexpr int hd = 16 * NV;
  constexpr size_t kAheadBytes = 16 << 10;  // as far as the one-head loops reach at head_dim 128
  const int bs = kv.block_size, n = pos + 1, first = kv.first_key(pos);
  const int b_first = first / bs, b_end = (n + bs - 1) / bs;
  const int kv0 = h0 / group, kv1 = (h1 - 1) / group + 1;
  const size_t run =
      size_t(kv1 - kv0) * hd * bs;  // elements of one block's K (or V) of these heads
  auto k_run = [&](int b) {
    return kv.k_base + (int64_t(kv.block_table[b]) * kv.kv_dim + int64_t(kv0) * hd) * bs;
  };
  auto v_run = [&](int b) {
    return kv.v_base + (int64_t(kv.block_table[b]) * kv.kv_dim + int64_t(kv0) * hd) * bs;
  };
  const int ahead =
      int(std::max<size_t>(1, (kAheadBytes + run * sizeof(KvT) - 1) / (run * sizeof(KvT))));
  auto row = [&](int h) { return scores + size_t(h - h0) * stride; };
  LaneBatch<KvT> lanes{hd, bs, scale};
  for (int b = b_first; b < b_end; ++b) {
    if (b + ahead < b_end)
      prefetch_run(k_run(b + ahead), run * sizeof(KvT));
    else if (b_first + b + ahead - b_end < b_end)
      prefetch_run(v_run(b_first + b + ahead - b_end), run * sizeof(KvT));
    const int g0 = b == b_first ? first % bs / 16 : 0,
              g1 = b == b_end - 1 ? (n - b * bs + 15) / 16 : bs / 16;
    const KvT* kb = k_run(b);
    for (int h = h0; h < h1; ++h)
      for (int g = g0; g < g1; ++g)
        lanes.add(q + size_t(h) * hd, kb + size_t(h / group - kv0) * hd * bs + g * 16,
                  row(h) + b * bs + g * 16);
  }
  lanes.flush();
  float sum[64];  // at most 64 heads per call (attend_heads)
  for (int h = h0; h < h1; ++h) {
    PagedHead<KvT> head = kv;
    head.has_sink = sinks != nullptr, head.sink = sinks ? sinks[h] : 0.f;
    sum[h - h0] = softmax_weights(row(h) + first, n - first, head);
    std::fill(out + size_t(h) * hd, out + size_t(h + 1) * hd, 0.f);
  }
  // weights[(b - b_first) * heads + (h - h0)][bs]: block b's weights of head h (the keys the
  // head attends; 16 floats of padding for add_weighted_values' last load).
  const int heads = h1 - h0;
  thread_local std::vector<float> weights;
  weights.resize(size_t(b_end - b_first) * heads * bs + 16);
  auto block_weights = [&](int b, int h) {
    return weights.data() + (size_t(b - b_first) * heads + (h - h0)) * bs;
  };
  for (int b = b_first; b < b_end; ++b)
    for (int h = h0; h < h1; ++h)
      std::memcpy(block_weights(b, h), row(h) + b * bs, size_t(bs) * sizeof(float));
  // Every kv head of a block (a whole token's heads): the runs of adjacent blocks are one stream.
  const bool whole_blocks = kv1 - kv0 == kv.kv_dim / hd;
  for (int b = b_first; b < b_end; ++b) {
    const int next = b + ahead;  // the first ones: in pass 1
    if (next < b_end && !(whole_blocks && kv.block_table[next] == kv.block_table[next - 1] + 1))
      prefetch_run(v_run(next), run * sizeof(KvT));
    const int j0 = std::max(first, b * bs), j1 = std::min(n, (b + 1) * bs);
    const KvT* vb = v_run(b);
    for (int h = h0; h < h1; ++h) {
      float* o = out + size_t(h) * hd;
      Vec16 acc[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[v] = Vec16::load(o + 16 * v);
      const float* w = block_weights(b, h) + (j0 - b * bs);
      const KvT* v = vb + size_t(h / group - kv0) * hd * bs + size_t(j0 - b * bs) * hd;
      if (whole_blocks)
        add_weighted_values<NV, true>(w, j1 - j0, v, acc);
      else
        add_weighted_values<NV, false>(w, j1 - j0, v, acc);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[v].store(o + 16 * v);
    }
  }
  for (int h = h0; h < h1; ++h) {
    const float inv = 1.f / sum[h - h0];
    for (int d = 0; d < hd; ++d) out[size_t(h) * hd + d] *= inv;
  }
}

template <int NV, typename KvT>
void attend_group_nv(const float* const* q, const int* pos, int nq, int hd, float scale,
                     const PagedHead<KvT>& kv, float* scores, int stride, float* const* out) {
  static_assert(kMaxGroup == 8);
  switch (nq) {
    case 1:
      attend_group_fixed<NV, 1>(q, pos, hd, scale, kv, scores, stride, out);
      break;
    case 2:
      attend_group_fixed<NV, 2>(q, pos, hd, scale, kv, scores, stride, out);
      break;
    case 3:
      attend_group_fixed<NV, 3>(q, pos, hd, scale, kv, scores, stride, out);
      break;
    case 4:
      attend_group_fixed<NV, 4>(q, pos, hd, scale, kv, scores, stride, out);
      break;
    case 5:
      attend_group_fixed<NV, 5>(q, pos, hd, scale, kv, scores, stride, out);
      break;
    case 6:
      attend_group_fixed<NV, 6>(q, pos, hd, scale, kv, scores, stride, out);
      break;
    case 7:
      attend_group_fixed<NV, 7>(q, pos, hd, scale, kv, scores, stride, out);
      break;
    default:
      attend_group_fixed<NV, 8>(q, pos, hd, scale, kv, scores, stride, out);
      break;
  }
}
#endif

}  // namespace

template <typename KvT>
void attend_group(const float* const* q, const int* pos, int nq, int hd, float scale,
                  const PagedHead<KvT>& kv, float* scores, int stride, float* const* out) {
#if defined(R3_VEC16)
  // Queries of a windowed layer read different key ranges: each on its own.
  if (kv.window == 0 && kv.block_size % 16 == 0 && nq >= 1 && nq <= kMaxGroup) {
    if (hd == 64) return attend_group_nv<4>(q, pos, nq, hd, scale, kv, scores, stride, out);
    if (hd == 128) return attend_group_nv<8>(q, pos, nq, hd, scale, kv, scores, stride, out);
  }
#endif
  for (int i = 0; i < nq; ++i)
    R3_ISA_NS::attend(q[i], hd, pos[i], scale, kv, scores + size_t(i) * stride, out[i]);
}

template <typename KvT>
void attend(const float* q, int hd, int pos, float scale, const PagedHead<KvT>& kv, float* scores,
            float* out) {
  const int n = pos + 1, first = kv.first_key(pos);
  bool vector_scores = false, vector_values = false;
#if defined(R3_VEC16)
  vector_scores = kv.block_size % 16 == 0;
  vector_values = vector_scores && hd % 16 == 0 && hd <= 128;
  if (vector_scores) group_scores<1>(&q, hd, scale, kv, first, n, scores, 0);
#endif
  if (!vector_scores) scores_portable(q, hd, first, pos, scale, kv, scores);
  const float sum = softmax_weights(scores + first, n - first, kv);  // weights replace the scores
#if defined(R3_VEC16)
  if (vector_values) [&]<int... I>(std::integer_sequence<int, I...>) {
      ((hd == 16 * (I + 1) ? group_values<I + 1, 1>(scores, 0, first, n, kv, &out) : void()), ...);
    }
  (std::make_integer_sequence<int, 8>{});
#endif
  if (!vector_values) {
    std::fill(out, out + hd, 0.f);
    weighted_values_tail(scores, first, n, kv, hd, out);
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < hd; ++d) out[d] *= inv;
}

template <typename KvT>
void attend_heads(const float* q, int h0, int h1, int group, int hd, int pos, float scale,
                  const PagedHead<KvT>& kv, const float* sinks, float* scores, int stride,
                  float* out) {
#if defined(R3_VEC16)
  if (kv.block_size % 16 == 0 && hd % 16 == 0 && hd <= 128) {
    for (int from = h0; from < h1; from += 64) {  // attend_heads_vec's sums live on its stack
      const int to = std::min(h1, from + 64);
      float* s = scores + size_t(from - h0) * stride;
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((hd == 16 * (I + 1)
              ? attend_heads_vec<I + 1>(q, from, to, group, pos, scale, kv, sinks, s, stride, out)
              : void()),
         ...);
      }
      (std::make_integer_sequence<int, 8>{});
    }
    return;
  }
#endif
  for (int h = h0; h < h1; ++h) {
    PagedHead<KvT> head = kv;
    head.head_offset = int64_t(h / group) * hd;
    head.has_sink = sinks != nullptr, head.sink = sinks ? sinks[h] : 0.f;
    R3_ISA_NS::attend(q + size_t(h) * hd, hd, pos, scale, head, scores + size_t(h - h0) * stride,
                      out + size_t(h) * hd);
  }
}

template void attend(const float*, int, int, float, const PagedHead<float>&, float*, float*);
template void attend(const float*, int, int, float, const PagedHead<uint16_t>&, float*, float*);
template void attend_group(const float* const*, const int*, int, int, float,
                           const PagedHead<float>&, float*, int, float* const*);
template void attend_group(const float* const*, const int*, int, int, float,
                           const PagedHead<uint16_t>&, float*, int, float* const*);
template void attend_heads(const float*, int, int, int, int, int, float, const PagedHead<float>&,
                           const float*, float*, int, float*);
template void attend_heads(const float*, int, int, int, int, int, float, const PagedHead<uint16_t>&,
                           const float*, float*, int, float*);

}  // namespace R3_ISA_NS
}  // namespace r3::kernels

#include "kernels/isa_end.h"
