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
  const KvT* k_base;      // K cache of this layer: [block][kv_dim][slot]
  const KvT* v_base;      // V cache of this layer: [block][kv_head][slot][head_dim]
  const int* block_table;
  int block_size;
  int64_t kv_dim;         // elements per (block, slot)
  int64_t head_offset;    // offset of this kv head inside kv_dim
  // Sliding window (0: none): a query at pos reads keys max(0, pos - window + 1)..pos only, and
  // no block before the first of them (they may have been freed).
  int window = 0;
  // Attention sink (GPT-OSS): a logit joining the softmax's max and denominator, with no value.
  bool has_sink = false;
  float sink = 0.f;
  int first_key(int pos) const { return window > 0 && pos >= window ? pos - window + 1 : 0; }
};

// Score of key j: fma over d = 0..head_dim-1 in order (acc = fma(q[d], k[d], acc)), times scale.
// Weight: exp_nonpositive(score - max) (kernels/exp.h); their sum in key order, then the sink's
// weight (the max includes the sink); out[d]: fma of weight and v[d] in key order, then times
// 1/sum. Keys are first_key(pos)..pos; scores are indexed by absolute key position.
// scores: scratch of at least pos + 1 rounded up to the block size. out: [head_dim].
template <typename KvT>
void attend(const float* q, int head_dim, int pos, float scale, const PagedHead<KvT>& kv, float* scores,
            float* out);

// Up to kMaxGroup queries of one head over the same sequence (positions pos[i], ascending or
// not), each computed exactly as attend() computes it: the group only shares the loads of K and
// V (prefill chunks would otherwise re-read the whole cache once per token). scores: nq rows of
// score_stride floats (>= max pos + 1 rounded up to the block size).
inline constexpr int kMaxGroup = 4;
template <typename KvT>
void attend_group(const float* const* q, const int* pos, int nq, int head_dim, float scale, const PagedHead<KvT>& kv,
                  float* scores, int score_stride, float* const* out);

}  // namespace r3::kernels
