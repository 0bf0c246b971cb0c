// The Gated DeltaNet block of the runner (Qwen3-Next, Qwen3.5): linear attention whose memory is a
// state per request, not a KV cache. The math is transformers' recurrent form
// (torch_recurrent_gated_delta_rule, the reference forward's deltanet()), token by token:
//   mixed = in_proj_qkv h  [C = 2 kd + vd: q, k, v channels]   z, b, a = in_proj_z/b/a h
//   conv  = silu(causal depthwise conv of mixed over the last conv_kernel positions)
//   per value head hv (key head hv / r): q, k L2-normalised (eps 1e-6), q /= sqrt(dk),
//   decay = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b),
//   S = decay S;  S += k (beta (v - S^T k))^T;  o = S^T q;  o = w * rmsnorm(o) * silu(z)
//
// Batch invariance: the projections are the batch-invariant matmuls; everything after them runs
// per request and token in position order, each (request, channel) or (request, head) on one
// thread in one fixed order of operations. A token's arithmetic is therefore the same whether it
// arrives in a prefill chunk of any size, a decode step or a recompute after preemption: the
// chunked (WY) form would give other bits at other chunk boundaries, so it is not used. The cost
// is a prefill that walks its tokens one by one through the state (two passes over its dk x dv
// floats per token and value head; docs/ARCHITECTURE.md has the measured share).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/scoped_nanoseconds.h"
#include "engine/model_runner.h"
#include "kernels/matmul.h"

namespace r3 {

namespace {
float silu(float x) { return x / (1.f + std::exp(-x)); }
float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's, threshold 20
void l2_normalise(float* v, int n) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += v[i] * v[i];
  const float inv = 1.f / std::sqrt(ss + 1e-6f);
  for (int i = 0; i < n; ++i) v[i] *= inv;
}
}  // namespace

void ModelRunner::deltanet(const StepPlan& plan, int l, const LayerWeights& L, int T) {
  const ModelConfig& c = config();
  const DeltaNetSpec& d = *c.deltanet;
  const int C = d.conv_dim(), kd = d.key_dim(), vd = d.value_dim(), nv = d.v_heads,
            dk = d.k_head_dim, dv = d.v_head_dim, r = d.v_heads / d.k_heads, K = d.conv_kernel,
            W = K - 1;
  const float eps = c.rms_norm_eps;
  ScopedNanoseconds timed{deltanet_ns_};
  const kernels::Activations hx{h_.data(), hb_.data(), T};
  const kernels::MatmulOut proj[] = {{&L.dn_qkv, dn_mixed_.data()},
                                     {&L.dn_z, dn_z_.data()},
                                     {&L.dn_b, dn_b_.data()},
                                     {&L.dn_a, dn_a_.data()}};
  kernels::matmul_many(hx, proj, pool_);
  weight_bytes_ +=
      L.dn_qkv.nbytes() + L.dn_z.nbytes() + L.dn_b.nbytes() + L.dn_a.nbytes() + L.o.nbytes();
  const int S = int(plan.seqs.size());
  // The small tensors widened to fp32 once per step (they are read per token and channel).
  thread_local std::vector<float> conv_w, norm_w;
  conv_w.resize(size_t(C) * K);
  norm_w.resize(size_t(dv));
  for (int64_t i = 0; i < int64_t(C) * K; ++i) conv_w[size_t(i)] = L.dn_conv.at(i);
  for (int j = 0; j < dv; ++j) norm_w[size_t(j)] = L.dn_norm.at(j);
  const float* cw = conv_w.data();
  const float* nw = norm_w.data();
  // A request starting at position 0 (admitted, or recomputing after preemption) starts from a
  // zero state, whatever the slot's previous owner left there; one starting at a prefix hit's
  // end, from the snapshot taken there (pinned by the plan: no sequence of this step writes it).
  for (const PlannedSeq& s : plan.seqs) {
    if (s.num_tokens == 0) continue;
    float* st = deltanet_state(s.state_slot, l);
    if (s.snapshot_restore >= 0)
      std::copy_n(deltanet_snapshot(s.snapshot_restore, l), dn_state_floats_, st);
    else if (s.start_pos == 0)
      std::fill(st, st + dn_state_floats_, 0.f);
  }
  // The conv, per (request, channel): each token's window reads earlier tokens of this step or,
  // before them, the request's conv state (the last K - 1 inputs, oldest first), which then
  // moves on to this step's last K - 1 inputs.
  const int64_t state_k = int64_t(nv) * dk * dv;  // the recurrent part comes first
  pool_->parallel_for(int64_t(S) * C, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const PlannedSeq& s = plan.seqs[size_t(i / C)];
      const int ch = int(i % C), n = s.num_tokens;
      if (n == 0) continue;
      float* window = deltanet_state(s.state_slot, l) + state_k + int64_t(ch) * W;
      for (int t = 0; t < n; ++t) {
        float acc = 0.f;
        for (int j = 0; j < K; ++j) {
          const int at = t - W + j;  // relative to the step's first token of the request
          const float in =
              at >= 0 ? dn_mixed_[size_t(s.first_token + at) * C + ch] : window[W + at];
          acc += cw[int64_t(ch) * K + j] * in;
        }
        dn_conv_[size_t(s.first_token + t) * C + ch] = silu(acc);
      }
      // The window after the step's first `tokens` tokens: (window ++ inputs)[tokens, + W),
      // written to `to` ascending, each element read at or after the one written (so `to` may be
      // the window itself).
      auto window_after = [&](int tokens, float* to) {
        for (int m = 0; m < W; ++m) {
          const int u = tokens + m;
          to[m] = u < W ? window[u] : dn_mixed_[size_t(s.first_token + u - W) * C + ch];
        }
      };
      // Before the window moves on: the snapshot's, and with drafts (speculative decoding) the
      // one after each of the first num_drafts tokens.
      if (s.snapshot_write >= 0)
        window_after(s.snapshot_tokens,
                     deltanet_snapshot(s.snapshot_write, l) + state_k + int64_t(ch) * W);
      for (int j = 0; s.draft_slot >= 0 && j < s.num_drafts; ++j)
        window_after(j + 1, deltanet_draft(s.draft_slot, j, l) + state_k + int64_t(ch) * W);
      window_after(n, window);  // window' = (window ++ this step's inputs)[n, n + W)
    }
  });
  // The delta rule and the gated norm, per (request, value head), tokens in order. Two passes
  // over the state [dk][dv] a token, row by row (each output column still sums its dk terms in
  // ascending i, as the reference does): decay and S^T k; then the update and S^T q of the
  // updated state.
  pool_->parallel_for_each(int64_t(S) * nv, [&](int64_t item) {
    const PlannedSeq& s = plan.seqs[size_t(item / nv)];
    const int hv = int(item % nv), hk = hv / r;
    if (s.num_tokens == 0) return;
    float* st = deltanet_state(s.state_slot, l) + int64_t(hv) * dk * dv;  // [dk][dv]
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(2 * dk + dv));
    float *q = scratch.data(), *k = q + dk, *kv = k + dk;
    const float qscale = 1.f / std::sqrt(float(dk));
    const float a_log = L.dn_a_log.at(hv), dt_bias = L.dn_dt_bias.at(hv);
    for (int t = s.first_token; t < s.first_token + s.num_tokens; ++t) {
      const float* row = &dn_conv_[size_t(t) * C];
      for (int i = 0; i < dk; ++i) q[i] = row[hk * dk + i], k[i] = row[kd + hk * dk + i];
      l2_normalise(q, dk);
      l2_normalise(k, dk);
      for (int i = 0; i < dk; ++i) q[i] *= qscale;
      const float* v = row + 2 * kd + hv * dv;
      const float g = -std::exp(a_log) * softplus(dn_a_[size_t(t) * nv + hv] + dt_bias);
      const float decay = std::exp(g), beta = sigmoid(dn_b_[size_t(t) * nv + hv]);
      std::fill(kv, kv + dv, 0.f);
      for (int i = 0; i < dk; ++i) {
        float* srow = st + i * dv;
        const float ki = k[i];
        for (int j = 0; j < dv; ++j) {
          srow[j] *= decay;
          kv[j] += srow[j] * ki;
        }
      }
      for (int j = 0; j < dv; ++j) kv[j] = (v[j] - kv[j]) * beta;
      float* o = &attn_[size_t(t) * vd + size_t(hv) * dv];
      std::fill(o, o + dv, 0.f);
      for (int i = 0; i < dk; ++i) {
        float* srow = st + i * dv;
        const float ki = k[i], qi = q[i];
        for (int j = 0; j < dv; ++j) {
          srow[j] += ki * kv[j];
          o[j] += srow[j] * qi;
        }
      }
      float ss = 0.f;
      for (int j = 0; j < dv; ++j) ss += o[j] * o[j];
      const float inv = 1.f / std::sqrt(ss / float(dv) + eps);
      const float* z = &dn_z_[size_t(t) * vd + size_t(hv) * dv];
      for (int j = 0; j < dv; ++j) o[j] = o[j] * inv * nw[j] * silu(z[j]);
      if (const int j = t - s.first_token; s.draft_slot >= 0 && j < s.num_drafts)
        std::copy_n(st, int64_t(dk) * dv,
                    deltanet_draft(s.draft_slot, j, l) + int64_t(hv) * dk * dv);
      if (t + 1 - s.first_token == s.snapshot_tokens &&
          s.snapshot_write >= 0)  // the state at the boundary
        std::copy_n(st, int64_t(dk) * dv,
                    deltanet_snapshot(s.snapshot_write, l) + int64_t(hv) * dk * dv);
    }
  });
  // Padding tokens (no request) attend to nothing.
  for (int t = 0; t < T; ++t)
    if (plan.tokens[size_t(t)].seq < 0) std::fill_n(&attn_[size_t(t) * vd], vd, 0.f);
}

}  // namespace r3
