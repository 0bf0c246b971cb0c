// The MLA attention block of the runner (DeepSeek-V3): the absorbed per-head weights and the
// latent attention over the cached rows (kernels/attention_latent.h).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/scoped_nanoseconds.h"
#include "engine/model_runner.h"
#include "kernels/attention_latent.h"
#include "kernels/matmul.h"

namespace r3 {

using kernels::Activations;
using kernels::matmul;
using kernels::matmul_rows;
using kernels::rms_norm;
using kernels::round_to_bf16;

// MLA's absorbed weights, per layer and head, from kv_b ([nh x (nope + v), kv_lora]): the key
// part transposed, uk_t [kv_lora, nope] (a copy, so the query can be taken into the latent space
// by one matmul), and the value part uv [v, kv_lora] (a view of kv_b's rows).
void ModelRunner::build_mla_heads() {
  const ModelConfig& c = config();
  mla_heads_.clear();
  mla_storage_.clear();
  if (!c.mla) return;
  const MlaSpec& m = *c.mla;
  const int nh = c.num_heads, nope = m.qk_nope_head_dim, vd = m.v_head_dim, kvr = m.kv_lora_rank;
  mla_heads_.resize(weights_.layers.size());
  for (size_t l = 0; l < weights_.layers.size(); ++l) {
    const TensorView& kv_b = weights_.layers[l].kv_b;
    const size_t es = dtype_size(kv_b.dtype);
    const auto* base = static_cast<const uint8_t*>(kv_b.data);
    for (int h = 0; h < nh; ++h) {
      MlaHead head;
      std::vector<uint8_t>& store = mla_storage_.emplace_back(size_t(kvr) * size_t(nope) * es);
      for (int n = 0; n < nope; ++n)
        for (int col = 0; col < kvr; ++col)
          std::memcpy(store.data() + (size_t(col) * nope + n) * es,
                      base + ((size_t(h) * (nope + vd) + n) * kvr + col) * es, es);
      head.uk_t.name = kv_b.name + "[uk_t " + std::to_string(h) + "]";
      head.uk_t.dtype = kv_b.dtype;
      head.uk_t.shape = {kvr, nope};
      head.uk_t.data = store.data();
      head.uv.name = kv_b.name + "[uv " + std::to_string(h) + "]";
      head.uv.dtype = kv_b.dtype;
      head.uv.shape = {vd, kvr};
      head.uv.data = base + (size_t(h) * (nope + vd) + nope) * kvr * es;
      mla_heads_[l].push_back(head);
    }
  }
}

// Per head h, y_h = W_h x_h for every token: x_h rows are [T][in] at xs + h * T * in, outputs
// land at y + h * out_stride with row stride ldy. Items are (head, 64-row block) on the pool.
void ModelRunner::per_head_matmul(const std::vector<MlaHead>& heads, bool key, const float* xs,
                                  const uint16_t* xb, int T, int in, float* y, int ldy,
                                  int out_stride) {
  const int nh = int(heads.size());
  const int rows = int((key ? heads[0].uk_t : heads[0].uv).shape[0]);
  const int blocks = (rows + 63) / 64;
  pool_->parallel_for_each(int64_t(nh) * blocks, [&](int64_t i) {
    const int h = int(i / blocks), b = int(i % blocks);
    const TensorView& W = key ? heads[size_t(h)].uk_t : heads[size_t(h)].uv;
    const Activations x{xs + size_t(h) * T * in, xb + size_t(h) * T * in, T};
    kernels::matmul_rows(x, W, y + size_t(h) * out_stride, ldy, b * 64,
                         std::min(rows, b * 64 + 64));
  });
}

// Multi-head latent attention in the absorbed form, the same for every token whatever the step
// (so batch invariance holds): q through the low-rank path, the latent (normed) and its rotary
// key part cached per token; each head's query taken into the latent space (uk_t), attention over
// the cached rows (kernels/attention_latent.h), and the latent output taken to the head's value
// space (uv). attn_ gets [T, nh x v_head_dim].
template <typename KvT>
void ModelRunner::mla_attention(const StepPlan& plan, int layer, const LayerWeights& L, int T,
                                KvCache<KvT>& cache) {
  const ModelConfig& c = config();
  const MlaSpec& m = *c.mla;
  const int nh = c.num_heads, qk = m.qk_head_dim(), nope = m.qk_nope_head_dim, kvr = m.kv_lora_rank,
            lw = m.latent_width(), vd = m.v_head_dim;
  const AttentionSpec& a = c.layers[size_t(layer)].attention;
  const Activations hx{h_.data(), hb_.data(), T};
  if (!L.q_a.empty()) {
    const int qr = m.q_lora_rank;
    matmul(hx, L.q_a, qa_.data(), pool_);
    pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* a = qa_.data() + size_t(t) * qr;
        rms_norm(a, L.q_a_norm, 0, qr, kMlaNormEps, a);
        round_to_bf16(a, qr, qab_.data() + size_t(t) * qr);
      }
    });
    matmul({qa_.data(), qab_.data(), T}, L.q, q_.data(), pool_);
  } else {
    matmul(hx, L.q, q_.data(), pool_);
  }
  matmul(hx, L.kv_a, k_.data(), pool_);  // [T, latent + rope]
  weight_bytes_ += L.q_a.nbytes() + L.q.nbytes() + L.kv_a.nbytes() + L.kv_b.nbytes() + L.o.nbytes();
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const PlannedToken& tok = plan.tokens[size_t(t)];
      float* lat = &k_[size_t(t) * lw];
      rms_norm(lat, L.kv_a_norm, 0, kvr, kMlaNormEps, lat);
      rotate(lat + kvr, tok.position, a.rope_interleaved);
      float* q = &q_[size_t(t) * nh * qk];
      for (int h = 0; h < nh; ++h) {
        rotate(q + h * qk + nope, tok.position, a.rope_interleaved);
        // Head-major copies of q_nope (the per-head matmul's input rows) and q_pe (the tail of
        // the head's latent-space query).
        float* qn = &q_nope_[(size_t(h) * T + size_t(t)) * nope];
        std::copy(q + h * qk, q + h * qk + nope, qn);
        round_to_bf16(qn, nope, &q_nopeb_[(size_t(h) * T + size_t(t)) * nope]);
        std::copy(q + h * qk + nope, q + (h + 1) * qk, &q_lat_[(size_t(t) * nh + h) * lw + kvr]);
      }
      if (tok.seq < 0) continue;  // padding: never attended to
      cache.write_row(layer, tok.block, tok.slot, lat);
    }
  });
  // q_lat[t, h, 0:kvr] = uk_t_h q_nope[h, t]
  per_head_matmul(mla_heads_[size_t(layer)], true, q_nope_.data(), q_nopeb_.data(), T, nope,
                  q_lat_.data(), nh * lw, lw);
  // DeepseekV3Attention: qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2.
  const float scale = float(1.0 / std::sqrt(double(qk)) * c.rope_scaling.softmax_mscale);
  {  // attention over the cache, timed (EngineStats::attention_seconds)
    ScopedNanoseconds timed{attention_ns_};
    // Items of (token, group of heads): up to kLatentHeads heads share each pass over the rows,
    // in smaller groups when that leaves threads idle (the same bits either way).
    const int groups = std::max((nh + kernels::kLatentHeads - 1) / kernels::kLatentHeads,
                                std::min(nh, (pool_->size() + T - 1) / std::max(1, T)));
    const int per_group = (nh + groups - 1) / groups;
    pool_->parallel_for_each(int64_t(T) * groups, [&](int64_t i) {
      const int t = int(i / groups), h0 = int(i % groups) * per_group,
                h1 = std::min(nh, h0 + per_group);
      const PlannedToken& tok = plan.tokens[size_t(t)];
      const int keys = tok.position + 1;  // the score rows' stride
      thread_local std::vector<float> scores;
      if (scores.size() < size_t(per_group) * size_t(keys))
        scores.resize(size_t(per_group) * size_t(keys));
      float* o = &o_lat_[size_t(t) * kvr];  // head h's output at o + h * T * kvr
      const size_t o_stride = size_t(T) * size_t(kvr);
      if (tok.seq < 0) {
        for (int h = h0; h < h1; ++h) std::fill(o + h * o_stride, o + h * o_stride + kvr, 0.f);
      } else {
        const kernels::PagedLatent<KvT> rows{
            cache.k_layer(layer), plan.block_table(plan.seqs[size_t(tok.seq)]), block_size_, lw};
        kernels::attend_latent_heads(&q_lat_[size_t(t) * nh * lw], h0, h1, kvr, tok.position, scale,
                                     rows, scores.data(), keys, o, o_stride);
      }
      for (int h = h0; h < h1; ++h)
        round_to_bf16(o + h * o_stride, kvr, &o_latb_[(size_t(h) * T + size_t(t)) * kvr]);
    });
  }
  // attn[t, h * vd : (h + 1) * vd] = uv_h o_lat[h, t]
  per_head_matmul(mla_heads_[size_t(layer)], false, o_lat_.data(), o_latb_.data(), T, kvr,
                  attn_.data(), nh * vd, vd);
}

template void ModelRunner::mla_attention(const StepPlan&, int, const LayerWeights&, int,
                                         KvCache<float>&);
template void ModelRunner::mla_attention(const StepPlan&, int, const LayerWeights&, int,
                                         KvCache<uint16_t>&);

}  // namespace r3
