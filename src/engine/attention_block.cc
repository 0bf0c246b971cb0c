// The GQA attention block of the runner: projections, biases, q/k norms, clipping, RoPE, the KV
// writes, and attention over the paged cache (kernels/attention.h).
#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/scoped_nanoseconds.h"
#include "engine/model_runner.h"
#include "kernels/attention.h"
#include "kernels/attention_choice.h"
#include "kernels/matmul.h"

namespace r3 {

using kernels::Activations;
using kernels::rms_norm;

// Attention of every real token over its request's keys 0..pos (kernels/attention.h), per
// (head, group); a group is up to kMaxGroup consecutive tokens of one request, which share each
// load of K and V.
template <typename KvT>
void ModelRunner::attention(const StepPlan& plan, int layer, const float* q, float* out,
                            KvCache<KvT>& cache) {
  const ModelConfig& c = config();
  const int nh = c.num_heads, hd = c.head_dim, group = c.num_heads / c.num_kv_heads;
  const int qd = nh * hd;
  const float scale = 1.f / std::sqrt(float(hd));
  const int T = int(plan.tokens.size());
  const KvT* k = cache.k_layer(cache_layer_[size_t(layer)]);
  const KvT* v = cache.v_layer(cache_layer_[size_t(layer)]);
  const bool windowed = sliding(layer);  // its own pool and block table
  attn_groups_.clear();
  bool single_tokens = true;
  for (int t = 0; t < T;) {
    const int seq = plan.tokens[size_t(t)].seq;
    int n = 1;
    while (seq >= 0 && n < kernels::kMaxGroup && t + n < T && plan.tokens[size_t(t + n)].seq == seq)
      ++n;
    attn_groups_.push_back({t, n});
    single_tokens = single_tokens && n == 1;
    t += n;
  }
  const int G = int(attn_groups_.size());
  const int stride = rope_.max_pos() + block_size_;
  const AttentionSpec& spec = c.layers[size_t(layer)].attention;
  const TensorView& sinks = weights_.layers[size_t(layer)].sinks;
  auto attend_head = [&](int head, const AttentionGroup& g) {
    thread_local std::vector<float> scores;
    if (scores.size() < size_t(kernels::kMaxGroup) * size_t(stride))
      scores.resize(size_t(kernels::kMaxGroup) * size_t(stride));
    const PlannedToken& first = plan.tokens[size_t(g.first)];
    if (first.seq < 0) {  // padding
      float* o = out + size_t(g.first) * qd + size_t(head) * hd;
      std::fill(o, o + hd, 0.f);
      return;
    }
    const float* qs[kernels::kMaxGroup];
    float* os[kernels::kMaxGroup];
    int pos[kernels::kMaxGroup];
    for (int k = 0; k < g.count; ++k) {
      const size_t at = size_t(g.first + k) * qd + size_t(head) * hd;
      qs[k] = q + at;
      os[k] = out + at;
      pos[k] = plan.tokens[size_t(g.first + k)].position;
    }
    const PlannedSeq& seq = plan.seqs[size_t(first.seq)];
    kernels::PagedHead<KvT> kv{k,
                               v,
                               windowed ? plan.window_table(seq) : plan.block_table(seq),
                               block_size_,
                               int64_t(kv_dim_),
                               int64_t(head / group) * hd};
    kv.window = spec.sliding_window;
    if (spec.sinks) kv.has_sink = true, kv.sink = sinks.at(head);
    kernels::attend_group(qs, pos, g.count, hd, scale, kv, scores.data(), stride, os);
  };
  // Items handed out dynamically (later positions have more keys). A decode step's tokens share
  // nothing, so an item is one token with a range of its heads, all of them when there are
  // tokens enough to keep every core busy: attend_heads walks the token's blocks once for the
  // range, each block's heads being one run of the cache. Fewer tokens than cores (batch 1 of a
  // long context) split their kv heads over the cores; a head's bits never depend on the split.
  // Where the machine runs one head at a time faster (timed at start-up,
  // kernels/attention_choice.h), an item runs its heads that way, with the same bits.
  // Otherwise items are (head, group), head-major: consecutive items on both cores read the same
  // head's keys and values, which then stay in L2 across a chunk.
  if (single_tokens) {
    const int nkv = c.num_kv_heads;
    const int splits = std::clamp((2 * pool_->size() + G - 1) / G, 1, nkv);
    const kernels::DecodeAttention loop = kernels::decode_attention();
    if (spec.sinks) {
      sink_logits_.resize(size_t(nh));
      for (int h = 0; h < nh; ++h) sink_logits_[size_t(h)] = sinks.at(h);
    }
    pool_->parallel_for_each(int64_t(G) * splits, [&](int64_t i) {
      const AttentionGroup& g = attn_groups_[size_t(i / splits)];
      const int part = int(i % splits);
      const int h0 = nkv * part / splits * group, h1 = nkv * (part + 1) / splits * group;
      float* o = out + size_t(g.first) * qd;
      const PlannedToken& token = plan.tokens[size_t(g.first)];
      if (token.seq < 0) {  // padding
        std::fill(o + size_t(h0) * hd, o + size_t(h1) * hd, 0.f);
        return;
      }
      thread_local std::vector<float> scores;
      if (scores.size() < size_t(h1 - h0) * size_t(stride))
        scores.resize(size_t(h1 - h0) * size_t(stride));
      const PlannedSeq& seq = plan.seqs[size_t(token.seq)];
      kernels::PagedHead<KvT> kv{k,
                                 v,
                                 windowed ? plan.window_table(seq) : plan.block_table(seq),
                                 block_size_,
                                 int64_t(kv_dim_),
                                 0};
      kv.window = spec.sliding_window;
      if (loop == kernels::DecodeAttention::Heads) {
        kernels::attend_heads(q + size_t(g.first) * qd, h0, h1, group, hd, token.position, scale,
                              kv, spec.sinks ? sink_logits_.data() : nullptr, scores.data(), stride,
                              o);
        return;
      }
      for (int h = h0; h < h1;
           ++h) {  // the same bits, one head at a time (kernels/attention_choice.h)
        kv.head_offset = int64_t(h / group) * hd;
        kv.has_sink = spec.sinks;
        if (spec.sinks) kv.sink = sink_logits_[size_t(h)];
        kernels::attend(q + size_t(g.first) * qd + size_t(h) * hd, hd, token.position, scale, kv,
                        scores.data(), o + size_t(h) * hd);
      }
    });
  } else {
    pool_->parallel_for_each(
        int64_t(G) * nh, [&](int64_t i) { attend_head(int(i / G), attn_groups_[size_t(i % G)]); });
  }
}

// Grouped-query attention: q/k/v projections (with biases), q/k norms, clipping and RoPE per
// token, the token's K and V into its cache slot, then attention over the paged cache. attn_ gets
// [T, heads x head_dim].
template <typename KvT>
void ModelRunner::gqa_attention(const StepPlan& plan, int l, const LayerWeights& L, int T,
                                KvCache<KvT>& cache) {
  const ModelConfig& c = config();
  const int nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim, qd = nh * hd, kvd = nkv * hd;
  const float eps = c.rms_norm_eps;
  const AttentionSpec& a = c.layers[size_t(l)].attention;
  const Activations hx{h_.data(), hb_.data(), T};
  // With an output gate, q_proj's rows are per head [query, gate]: into qg_, then split.
  const kernels::MatmulOut qkv[] = {
      {&L.q, a.output_gate ? qg_.data() : q_.data()}, {&L.k, k_.data()}, {&L.v, v_.data()}};
  kernels::matmul_many(hx, qkv, pool_);
  weight_bytes_ += L.q.nbytes() + L.k.nbytes() + L.v.nbytes() + L.o.nbytes();
  // Per token (both cores): q/k norms, RoPE, and the token's K and V into its cache slot. The
  // transposed K write touches a cache line per one or two K elements, so it is worth splitting.
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* q = &q_[size_t(t) * qd];
      float* k = &k_[size_t(t) * kvd];
      float* v = &v_[size_t(t) * kvd];
      if (a.output_gate)
        for (int hh = 0; hh < nh; ++hh) {
          const float* src = &qg_[size_t(t) * 2 * qd + size_t(hh) * 2 * hd];
          std::copy(src, src + hd, q + hh * hd);
          std::copy(src + hd, src + 2 * hd, &attn_gate_[size_t(t) * qd + size_t(hh) * hd]);
        }
      if (a.qkv_bias) {
        kernels::add_bias(q, L.q_bias, 0, qd);
        kernels::add_bias(k, L.k_bias, 0, kvd);
        kernels::add_bias(v, L.v_bias, 0, kvd);
      }
      if (a.qk_norm == QkNorm::PerHead) {
        for (int hh = 0; hh < nh; ++hh)
          rms_norm(q + hh * hd, L.q_norm, 0, hd, eps, q + hh * hd, norm_offset_);
        for (int hh = 0; hh < nkv; ++hh)
          rms_norm(k + hh * hd, L.k_norm, 0, hd, eps, k + hh * hd, norm_offset_);
      } else if (a.qk_norm == QkNorm::Whole) {
        rms_norm(q, L.q_norm, 0, qd, eps, q);
        rms_norm(k, L.k_norm, 0, kvd, eps, k);
      }
      if (a.clip_qkv) {
        const float cl = *a.clip_qkv;
        for (int i = 0; i < qd; ++i) q[i] = std::clamp(q[i], -cl, cl);
        for (int i = 0; i < kvd; ++i) k[i] = std::clamp(k[i], -cl, cl);
        for (int i = 0; i < kvd; ++i) v[i] = std::clamp(v[i], -cl, cl);
      }
      const PlannedToken& tok = plan.tokens[size_t(t)];
      for (int hh = 0; hh < nh; ++hh) rotate(q + hh * hd, tok.position, a.rope_interleaved);
      for (int hh = 0; hh < nkv; ++hh) rotate(k + hh * hd, tok.position, a.rope_interleaved);
      if (tok.seq < 0) continue;  // padding: never attended to, and its scratch slots repeat
      if (sliding(l))
        cache.write_gqa(cache_layer_[size_t(l)], tok.window_block, tok.slot, k, v, hd);
      else
        cache.write_gqa(cache_layer_[size_t(l)], tok.block, tok.slot, k, v, hd);
    }
  });
  {
    ScopedNanoseconds timed{attention_ns_};
    attention(plan, l, q_.data(), attn_.data(), cache);
  }
  if (a.output_gate)  // Qwen3NextAttention: the output times sigmoid(gate), before o_proj
    pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
      for (int64_t i = t0 * qd; i < t1 * qd; ++i)
        attn_[size_t(i)] *= 1.f / (1.f + std::exp(-attn_gate_[size_t(i)]));
    });
}

template void ModelRunner::gqa_attention(const StepPlan&, int, const LayerWeights&, int,
                                         KvCache<float>&);
template void ModelRunner::gqa_attention(const StepPlan&, int, const LayerWeights&, int,
                                         KvCache<uint16_t>&);

}  // namespace r3
