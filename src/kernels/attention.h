// Attention of one query head over keys 0..pos of a paged KV cache, reduced in absolute position
// order in two passes (scores and their max, then the exp-weighted sum of values), so the result
// does not depend on how the positions were chunked, cached or batched.
#pragma once
#include <cstdint>

namespace r3::kernels {

// The cache holds fp32, or bf16 bits (uint16_t) that the kernels widen exactly to fp32 as they
// load them; everything after the load is the same fp32 arithmetic.
// K blocks are stored transposed, [block][kv_dim][slot], so the scores of a block's keys are
// computed 16 at a time (one lane per key); V blocks are [block][kv_head][slot][head_dim], so one
// head's values of a block are one contiguous run (easy to prefetch, no 4 KiB strides).
template <typename KvT>
struct PagedHead {
  const KvT* k_base;  // K cache of this layer: [block][kv_dim][slot]
  const KvT* v_base;  // V cache of this layer: [block][kv_head][slot][head_dim]
  const int* block_table;
  int block_size;
  int64_t kv_dim;       // elements per (block, slot)
  int64_t head_offset;  // offset of this kv head inside kv_dim
  // Sliding window (0: none): a query at pos reads keys max(0, pos - window + 1)..pos only, and
  // no block before the first of them (they may have been freed).
  int window = 0;
  // Attention sink (GPT-OSS): a logit joining the softmax's max and denominator, with no value.
  bool has_sink = false;
  float sink = 0.f;
  int first_key(int pos) const { return window > 0 && pos >= window ? pos - window + 1 : 0; }
};

// Score of key j: fma over d = 0..head_dim-1 in order (acc = fma(q[d], k[d], acc)), times scale.
// Weight: exp_nonpositive(score - max) (kernels/exp.h); their sum: weight j (counted from the
// first key) added into lane j % 16 in key order, the 16 lanes summed by dot.h's pairwise tree,
// then the sink's weight added (the max includes the sink); out[d]: fma of weight and v[d] in
// key order, then times 1/sum. Keys are first_key(pos)..pos; scores are indexed by absolute key
// position.
// scores: scratch of at least pos + 1 rounded up to the block size. out: [head_dim].
template <typename KvT>
void attend(const float* q, int head_dim, int pos, float scale, const PagedHead<KvT>& kv,
            float* scores, float* out);

// Up to kMaxGroup queries of one head over the same sequence (positions pos[i], ascending or
// not), each computed exactly as attend() computes it: the group only shares the loads of K and
// V (prefill chunks would otherwise re-read the whole cache once per token). scores: nq rows of
// score_stride floats (>= max pos + 1 rounded up to the block size).
inline constexpr int kMaxGroup = 8;
template <typename KvT>
void attend_group(const float* const* q, const int* pos, int nq, int head_dim, float scale,
                  const PagedHead<KvT>& kv, float* scores, int score_stride, float* const* out);

// Query heads [h0, h1) of one token at pos, query head h reading kv head h / group: each head's
// output is attend()'s, bit for bit. The loops walk the sequence's blocks once for all these
// heads, reading a block's K (then V) of their kv heads as one contiguous run, where a head at a
// time reads head_dim x block_size elements of each block and jumps to the next (decode streams
// the cache; long runs keep more of it in flight). kv: the layer (head_offset 0; has_sink and
// sink unused). sinks: [heads] or null. q, out: [heads][head_dim] of the token, by absolute head.
// scores: (h1 - h0) rows of score_stride floats (>= pos + 1 rounded up to the block size).
template <typename KvT>
void attend_heads(const float* q, int h0, int h1, int group, int head_dim, int pos, float scale,
                  const PagedHead<KvT>& kv, const float* sinks, float* scores, int score_stride,
                  float* out);

}  // namespace r3::kernels
