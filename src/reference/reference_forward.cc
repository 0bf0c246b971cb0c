// The reference forward, written top to bottom like llama2.c: embed, then per decoder layer
// attention and FFN (dense or MoE) over the whole sequence, then the final norm and lm_head.
// Hugging Face semantics throughout (FACTS.md); every activation is fp32 and every reduction is a
// plain sequential fp32 loop.
#include "reference/reference_forward.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/panel_layout.h"

namespace r3 {

namespace {

// Element i of a weight tensor as fp32. Same values as TensorView::at, but inline for the two
// dtypes make_model writes, so the small preset stays fast enough for tests.
inline float wt(const TensorView& t, int64_t i) {
  if (!t.data) return t.at(i);  // the packed panels (the checkpoint's only copy of its matrices)
  if (t.dtype == DType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(t.data)[i]);
  if (t.dtype == DType::F32) return static_cast<const float*>(t.data)[i];
  return t.at(i);
}

// Row r of W as fp32, into out[0, cols): read back from the packed panels (the same values as
// stored) or from the tensor's own data.
void weight_row(const TensorView& W, int64_t r, float* out) {
  const int64_t cols = W.shape[1];
  if (!W.data) return packed_row(W, r, out);
  for (int64_t c = 0; c < cols; ++c) out[c] = wt(W, r * cols + c);
}

// y = W x for W in the HF Linear layout [out, in]: y[r] = sum_c W[r, c] x[c], each row a plain
// sequential sum. Eight rows are summed side by side: each keeps its own order (the same bits as
// one row at a time), and eight independent chains of adds hide the add's latency.
void matvec(const TensorView& W, const float* x, float* y) {
  constexpr int kRows = 8;
  const int64_t rows = W.shape[0], cols = W.shape[1];
  std::vector<float> w(size_t(kRows * cols));
  int64_t r0 = 0;
  for (; r0 + kRows <= rows; r0 += kRows) {
    for (int k = 0; k < kRows; ++k) weight_row(W, r0 + k, w.data() + size_t(k * cols));
    float acc[kRows] = {};
    for (int64_t c = 0; c < cols; ++c)
      for (int k = 0; k < kRows; ++k) acc[k] += w[size_t(k * cols + c)] * x[c];
    for (int k = 0; k < kRows; ++k) y[r0 + k] = acc[k];
  }
  for (; r0 < rows; ++r0) {
    weight_row(W, r0, w.data());
    float acc = 0.f;
    for (int64_t c = 0; c < cols; ++c) acc += w[size_t(c)] * x[c];
    y[r0] = acc;
  }
}

// out = x / sqrt(mean(x^2) + eps) * (offset + w): offset 1 for zero-centred norms (Qwen3-Next,
// Qwen3.5: (1 + w), the sum in fp32 as transformers forms it). `out` may alias `x`.
void rmsnorm(float* out, const float* x, const TensorView& w, int n, float eps,
             float offset = 0.f) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / float(n) + eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * inv * (offset + wt(w, i));
}

// In-place softmax, max-subtracted so large logits do not overflow.
void softmax(float* x, int n) {
  float mx = x[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0.f;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  for (int i = 0; i < n; ++i) x[i] /= sum;
}

// RoPE of one layer's attention on a head's first rotary_dim dims. Frequencies in fp32 like
// HF's inv_freq: theta^(-2i/D), or YaRN's (rope_inv_freq) with cos/sin carrying its attention
// factor. Pairs (i, i + D/2) ("rotate half"), or adjacent pairs (2i, 2i + 1) for DeepSeek-V3's
// rope_interleave: the same rotation as rotate-half after de-interleaving, which q and k both
// undergo, so scores agree.
struct Rotary {
  std::vector<float> inv_freq;
  float att = 1.f;
  bool interleaved = false;

  Rotary(const ModelConfig& c, const AttentionSpec& a)
      : att(float(c.rope_scaling.attention_factor)), interleaved(a.rope_interleaved) {
    const int D = a.rotary_dim;
    const std::vector<double> yarn =
        c.rope_scaling.yarn ? rope_inv_freq(c, D) : std::vector<double>();
    for (int i = 0; i < D / 2; ++i)
      inv_freq.push_back(yarn.empty() ? 1.f / std::pow(c.rope_theta, float(2 * i) / float(D))
                                      : float(yarn[size_t(i)]));
  }

  void apply(float* v, int pos) const {
    const int half = int(inv_freq.size());
    for (int i = 0; i < half; ++i) {
      const float angle = float(pos) * inv_freq[size_t(i)];
      const float c = std::cos(angle) * att, s = std::sin(angle) * att;
      float& x = v[interleaved ? 2 * i : i];
      float& y = v[interleaved ? 2 * i + 1 : i + half];
      const float a = x, b = y;
      x = a * c - b * s;
      y = b * c + a * s;
    }
  }
};

float silu(float x) { return x / (1.f + std::exp(-x)); }
float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
// torch.nn.functional.softplus (beta 1, threshold 20).
float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// Gated DeltaNet of one layer over the whole sequence, as transformers' Qwen3NextGatedDeltaNet
// computes it with the recurrent rule (torch_recurrent_gated_delta_rule): per position the
// projections q k v (the conv's channels), z, b, a of the normed input; a causal depthwise conv of
// conv_kernel taps (the last multiplies the current position) and SiLU; per value head hv (key
// head hv / r): q and k L2-normalised (eps 1e-6), q scaled by 1/sqrt(dk), decay
// exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b); state [dk][dv] *= decay, then the
// delta rule S += k (beta (v - S^T k))^T, out = S^T q; the gated norm w * norm(out) * silu(z)
// per head (plain w); x += out_proj(out).
void deltanet(const ModelConfig& c, const LayerWeights& L, std::vector<float>& x, int S) {
  const DeltaNetSpec& d = *c.deltanet;
  const int H = c.hidden_size, C = d.conv_dim(), kd = d.key_dim(), vd = d.value_dim(),
            nv = d.v_heads;
  const int dk = d.k_head_dim, dv = d.v_head_dim, r = d.v_heads / d.k_heads, K = d.conv_kernel;
  const float eps = c.rms_norm_eps, zc = c.zero_centred_norms ? 1.f : 0.f;
  std::vector<float> h(H), mixed(size_t(S) * C), z(size_t(S) * vd), b(size_t(S) * nv),
      a(size_t(S) * nv);
  for (int p = 0; p < S; ++p) {
    rmsnorm(h.data(), &x[size_t(p) * H], L.input_norm, H, eps, zc);
    matvec(L.dn_qkv, h.data(), &mixed[size_t(p) * C]);
    matvec(L.dn_z, h.data(), &z[size_t(p) * vd]);
    matvec(L.dn_b, h.data(), &b[size_t(p) * nv]);
    matvec(L.dn_a, h.data(), &a[size_t(p) * nv]);
  }
  std::vector<float> conv(size_t(S) * C);
  for (int p = 0; p < S; ++p)
    for (int ch = 0; ch < C; ++ch) {
      float acc = 0.f;
      for (int j = 0; j < K; ++j) {
        const int q = p - (K - 1) + j;
        if (q >= 0) acc += wt(L.dn_conv, int64_t(ch) * K + j) * mixed[size_t(q) * C + ch];
      }
      conv[size_t(p) * C + ch] = silu(acc);
    }
  std::vector<float> state(size_t(nv) * dk * dv, 0.f), q(dk), k(dk), kv(dv), out(vd), delta(H);
  auto l2norm = [](float* v, int n) {
    float ss = 0.f;
    for (int i = 0; i < n; ++i) ss += v[i] * v[i];
    const float inv = 1.f / std::sqrt(ss + 1e-6f);
    for (int i = 0; i < n; ++i) v[i] *= inv;
  };
  const float qscale = 1.f / std::sqrt(float(dk));
  for (int p = 0; p < S; ++p) {
    const float* row = &conv[size_t(p) * C];
    for (int hv = 0; hv < nv; ++hv) {
      const int hk = hv / r;
      for (int i = 0; i < dk; ++i)
        q[size_t(i)] = row[hk * dk + i], k[size_t(i)] = row[kd + hk * dk + i];
      l2norm(q.data(), dk);
      l2norm(k.data(), dk);
      for (float& v : q) v *= qscale;
      const float* v = row + 2 * kd + hv * dv;
      const float g =
          -std::exp(wt(L.dn_a_log, hv)) * softplus(a[size_t(p) * nv + hv] + wt(L.dn_dt_bias, hv));
      const float decay = std::exp(g), beta = sigmoid(b[size_t(p) * nv + hv]);
      float* st = &state[size_t(hv) * dk * dv];  // [dk][dv]
      for (int i = 0; i < dk * dv; ++i) st[i] *= decay;
      for (int j = 0; j < dv; ++j) {
        float m = 0.f;
        for (int i = 0; i < dk; ++i) m += st[i * dv + j] * k[size_t(i)];
        kv[size_t(j)] = (v[j] - m) * beta;
      }
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) st[i * dv + j] += k[size_t(i)] * kv[size_t(j)];
      float* o = &out[size_t(hv) * dv];
      for (int j = 0; j < dv; ++j) {
        float acc = 0.f;
        for (int i = 0; i < dk; ++i) acc += st[i * dv + j] * q[size_t(i)];
        o[j] = acc;
      }
      float ss = 0.f;
      for (int j = 0; j < dv; ++j) ss += o[j] * o[j];
      const float inv = 1.f / std::sqrt(ss / float(dv) + eps);
      const float* zp = &z[size_t(p) * vd + size_t(hv) * dv];
      for (int j = 0; j < dv; ++j) o[j] = o[j] * inv * wt(L.dn_norm, j) * silu(zp[j]);
    }
    matvec(L.o, out.data(), delta.data());
    for (int i = 0; i < H; ++i) x[size_t(p) * H + i] += delta[size_t(i)];
  }
}

// Multi-head latent attention of one layer over the whole sequence, as transformers'
// DeepseekV3Attention computes it: per position the query (through the low-rank path when
// q_lora_rank is set), the latent and its rotary key part; kv_b expands the normed latent into
// each head's key (nope part) and value; causal softmax attention per head; x += o_proj(out).
void mla_attention(const ModelConfig& c, const Rotary& rotary, const LayerWeights& L,
                   std::vector<float>& x, int S) {
  const MlaSpec& m = *c.mla;
  const int H = c.hidden_size, nh = c.num_heads, qk = m.qk_head_dim(), nope = m.qk_nope_head_dim,
            rope_d = m.qk_rope_head_dim, vd = m.v_head_dim, kvr = m.kv_lora_rank;
  // qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (DeepseekV3Attention).
  const float eps = c.rms_norm_eps,
              scale = float(1.0 / std::sqrt(double(qk)) * c.rope_scaling.softmax_mscale);
  std::vector<float> q(size_t(S) * nh * qk), k(size_t(S) * nh * qk), v(size_t(S) * nh * vd);
  std::vector<float> h(static_cast<size_t>(H)), qa(size_t(std::max(m.q_lora_rank, 1))),
      lat(size_t(m.latent_width()));
  std::vector<float> kvb(size_t(nh) * (nope + vd));
  for (int p = 0; p < S; ++p) {
    rmsnorm(h.data(), &x[size_t(p) * H], L.input_norm, H, eps);
    float* qp = &q[size_t(p) * nh * qk];
    if (!L.q_a.empty()) {
      matvec(L.q_a, h.data(), qa.data());
      rmsnorm(qa.data(), qa.data(), L.q_a_norm, m.q_lora_rank, kMlaNormEps);
      matvec(L.q, qa.data(), qp);
    } else {
      matvec(L.q, h.data(), qp);
    }
    matvec(L.kv_a, h.data(), lat.data());
    rmsnorm(lat.data(), lat.data(), L.kv_a_norm, kvr, kMlaNormEps);  // the latent part only
    float* k_pe = lat.data() + kvr;
    rotary.apply(k_pe, p);
    matvec(L.kv_b, lat.data(), kvb.data());
    for (int hh = 0; hh < nh; ++hh) {
      rotary.apply(qp + hh * qk + nope, p);
      float* kh = &k[(size_t(p) * nh + hh) * qk];
      const float* src = &kvb[size_t(hh) * (nope + vd)];
      for (int i = 0; i < nope; ++i) kh[i] = src[i];
      for (int i = 0; i < rope_d; ++i) kh[nope + i] = k_pe[i];
      for (int i = 0; i < vd; ++i) v[(size_t(p) * nh + hh) * vd + i] = src[nope + i];
    }
  }
  std::vector<float> scores(static_cast<size_t>(S)), att(size_t(nh) * vd),
      delta(static_cast<size_t>(H));
  for (int p = 0; p < S; ++p) {
    for (int hh = 0; hh < nh; ++hh) {
      const float* qh = &q[(size_t(p) * nh + hh) * qk];
      for (int j = 0; j <= p; ++j) {
        const float* kj = &k[(size_t(j) * nh + hh) * qk];
        float dot = 0.f;
        for (int i = 0; i < qk; ++i) dot += qh[i] * kj[i];
        scores[size_t(j)] = dot * scale;
      }
      softmax(scores.data(), p + 1);
      float* out = &att[size_t(hh) * vd];
      for (int i = 0; i < vd; ++i) out[i] = 0.f;
      for (int j = 0; j <= p; ++j)
        for (int i = 0; i < vd; ++i)
          out[i] += scores[size_t(j)] * v[(size_t(j) * nh + hh) * vd + i];
    }
    matvec(L.o, att.data(), delta.data());
    for (int i = 0; i < H; ++i) x[size_t(p) * H + i] += delta[size_t(i)];
  }
}

void add_bias(float* x, const TensorView& b, int n) {
  for (int i = 0; i < n; ++i) x[i] += wt(b, i);
}

// Repeated argmax of score[0, n) over the entries with ok[e] (null: all); strict > keeps ties on
// the lower id.
void argmax_k(const float* score, int n, const std::vector<bool>* ok, int K, int16_t* chosen) {
  for (int kk = 0; kk < K; ++kk) {
    int best = -1;
    for (int e = 0; e < n; ++e) {
      bool taken = ok && !(*ok)[size_t(e)];
      for (int j = 0; j < kk; ++j) taken |= chosen[j] == e;
      if (!taken && (best < 0 || score[e] > score[best])) best = e;
    }
    chosen[kk] = int16_t(best);
  }
}

// The sigmoid router's own choice (DeepseekV3TopkRouter): biased scores, the topk_group groups
// with the best sum of their two best biased scores, then the K best eligible experts.
void sigmoid_choice(const RouterSpec& rs, const float* s, const TensorView& bias, int E, int K,
                    int16_t* chosen) {
  std::vector<float> choice(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) choice[size_t(e)] = s[e] + (bias.empty() ? 0.f : wt(bias, e));
  std::vector<bool> ok(size_t(E), true);
  if (rs.n_group > 1) {
    const int per = E / rs.n_group;
    std::vector<float> group(static_cast<size_t>(rs.n_group));
    for (int g = 0; g < rs.n_group; ++g) {
      std::vector<float> members(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(members.begin(), members.end(), [](float a, float b) { return a > b; });
      group[size_t(g)] = members[0] + members[1];
    }
    std::vector<int16_t> kept(static_cast<size_t>(rs.topk_group));
    argmax_k(group.data(), rs.n_group, nullptr, rs.topk_group, kept.data());
    ok.assign(size_t(E), false);
    for (int16_t g : kept)
      for (int e = 0; e < per; ++e) ok[size_t(g * per + e)] = true;
  }
  argmax_k(choice.data(), E, &ok, K, chosen);
}

// out = down(act(gate h, up h)) with the expert's biases where it has them: act is
// silu(g) * u, or GPT-OSS's clamped form (GptOssExperts): g = min(g, limit),
// u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha g). g and u: scratch.
void ffn(const ExpertWeights& e, const float* h, float* out, std::vector<float>& g,
         std::vector<float>& u, const ExpertActivation& act = {}) {
  const size_t I = size_t(e.gate.shape[0]);
  g.resize(I);
  u.resize(I);
  matvec(e.gate, h, g.data());
  matvec(e.up, h, u.data());
  if (!e.gate_bias.empty())
    for (size_t i = 0; i < I; ++i)
      g[i] += wt(e.gate_bias, int64_t(i)), u[i] += wt(e.up_bias, int64_t(i));
  for (size_t i = 0; i < I; ++i) {
    if (act.clamped) {
      const float gi = std::min(g[i], act.limit), ui = std::clamp(u[i], -act.limit, act.limit);
      g[i] = (ui + 1.f) * (gi * sigmoid(gi * act.alpha));
    } else {
      g[i] = silu(g[i]) * u[i];
    }
  }
  matvec(e.down, g.data(), out);
  if (!e.down_bias.empty())
    for (int64_t i = 0; i < e.down.shape[0]; ++i) out[i] += wt(e.down_bias, i);
}

std::string row_str(const int16_t* row, int K) {
  std::string s = "[";
  for (int k = 0; k < K; ++k) s += (k ? ", " : "") + std::to_string(row[k]);
  return s + "]";
}

// Every replay row must be all -1 (own router) or K distinct ids in [0, E); anything else is a
// staging bug the trainer must hear about, so it fails before any compute.
void check_replay(const ModelConfig& c, int S, const int16_t* replay, int rows) {
  if (rows < 0 || rows > S)
    throw Error("reference_forward: replay has " + std::to_string(rows) +
                " rows for a sequence of " + std::to_string(S) + " tokens (must be 0.." +
                std::to_string(S) + ")");
  if (rows > 0 && replay == nullptr)
    throw Error("reference_forward: replay_rows is " + std::to_string(rows) +
                " but replay is null");
  const int Lm = c.num_moe_layers(), K = c.top_k, E = c.num_experts;
  const std::vector<int> moe_layers = c.moe_layers();
  for (int p = 0; p < rows; ++p)
    for (int l = 0; l < Lm; ++l) {
      const int16_t* row = replay + (size_t(p) * Lm + l) * K;
      auto fail = [&](const std::string& why) {
        throw Error("reference_forward: replay row at position " + std::to_string(p) +
                    ", MoE layer " + std::to_string(l) + " (decoder layer " +
                    std::to_string(moe_layers[size_t(l)]) + ") " + row_str(row, K) + ": " + why);
      };
      int missing = 0;
      for (int k = 0; k < K; ++k) missing += row[k] == -1;
      if (missing == K) continue;
      if (missing > 0) fail("partly -1 (a row is either all -1 or K valid expert ids)");
      for (int k = 0; k < K; ++k) {
        if (row[k] < 0 || row[k] >= E)
          fail("expert id " + std::to_string(row[k]) + " outside [0, " + std::to_string(E) + ")");
        for (int j = 0; j < k; ++j)
          if (row[j] == row[k]) fail("duplicate expert id " + std::to_string(row[k]));
      }
    }
}

}  // namespace

ReferenceResult reference_forward(const ModelWeights& w, const std::vector<int>& tokens,
                                  const int16_t* replay, int replay_rows) {
  const ModelConfig& c = w.config;
  const int S = int(tokens.size()), H = c.hidden_size, V = c.vocab_size;
  const int nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int qd = nh * hd, kvd = nkv * hd, group = nh / nkv;
  const int E = c.num_experts, K = c.top_k, Lm = c.num_moe_layers();
  const float eps = c.rms_norm_eps, scale = 1.f / std::sqrt(float(hd));
  const float zc = c.zero_centred_norms ? 1.f : 0.f;  // norms applied as (1 + w)
  // Renormalise the top-k gate weights: always for Mixtral, else iff norm_topk_prob.
  const bool renorm = c.arch == Arch::Mixtral || c.norm_topk_prob;
  const bool sigmoid_router = c.router.scoring == RouterScoring::Sigmoid;

  for (int p = 0; p < S; ++p)
    if (tokens[size_t(p)] < 0 || tokens[size_t(p)] >= V)
      throw Error("reference_forward: token " + std::to_string(tokens[size_t(p)]) +
                  " at position " + std::to_string(p) + " is outside the vocabulary [0, " +
                  std::to_string(V) + ")");
  check_replay(c, S, replay, replay_rows);

  ReferenceResult r;
  r.seq_len = S;
  r.vocab = V;
  r.num_moe_layers = Lm;
  r.top_k = K;
  r.num_experts = E;
  r.logits.assign(size_t(S) * V, 0.f);
  r.routes.assign(size_t(S) * Lm * K, -1);
  r.router_probs.assign(size_t(S) * Lm * E, 0.f);
  r.gate_weights.assign(size_t(S) * Lm * K, 0.f);

  // The residual stream of every position, and per-layer activations of the whole sequence.
  std::vector<float> x(size_t(S) * H);
  std::vector<float> h(H), q(size_t(S) * qd), k(size_t(S) * kvd), v(size_t(S) * kvd),
      gate(size_t(S) * qd), qg(2 * qd);
  std::vector<float> att(qd), scores(S + 1), delta(H), eo(H), g, u, logits(E);

  for (int p = 0; p < S; ++p)
    for (int i = 0; i < H; ++i)
      x[size_t(p) * H + i] = wt(w.embed, int64_t(tokens[size_t(p)]) * H + i);

  int col = 0;  // MoE column of the current layer
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& L = w.layers[size_t(layer)];
    const AttentionSpec& attn = c.layers[size_t(layer)].attention;
    const Rotary rotary(c, attn);

    // --- attention: q, k, v for every position first (the sequence is its own KV cache) ---
    if (attn.kind == AttentionKind::Mla) mla_attention(c, rotary, L, x, S);
    if (attn.kind == AttentionKind::GatedDeltaNet) deltanet(c, L, x, S);
    for (int p = 0; p < S && attn.kind == AttentionKind::Gqa; ++p) {
      float* qp = &q[size_t(p) * qd];
      float* kp = &k[size_t(p) * kvd];
      float* vp = &v[size_t(p) * kvd];
      rmsnorm(h.data(), &x[size_t(p) * H], L.input_norm, H, eps, zc);
      if (attn.output_gate) {  // q_proj gives each head [query, gate] (Qwen3NextAttention)
        matvec(L.q, h.data(), qg.data());
        for (int hh = 0; hh < nh; ++hh)
          for (int i = 0; i < hd; ++i) {
            qp[hh * hd + i] = qg[size_t(hh * 2 * hd + i)];
            gate[size_t(p) * qd + hh * hd + i] = qg[size_t(hh * 2 * hd + hd + i)];
          }
      } else {
        matvec(L.q, h.data(), qp);
      }
      matvec(L.k, h.data(), kp);
      matvec(L.v, h.data(), vp);
      if (attn.qkv_bias) {  // Qwen2-MoE, GLM-4.5: q/k/v biases (o has none)
        add_bias(qp, L.q_bias, qd);
        add_bias(kp, L.k_bias, kvd);
        add_bias(vp, L.v_bias, kvd);
      }
      if (attn.qk_norm == QkNorm::PerHead) {  // Qwen3-MoE: each head over head_dim
        for (int hh = 0; hh < nh; ++hh) rmsnorm(qp + hh * hd, qp + hh * hd, L.q_norm, hd, eps, zc);
        for (int hh = 0; hh < nkv; ++hh) rmsnorm(kp + hh * hd, kp + hh * hd, L.k_norm, hd, eps, zc);
      } else if (attn.qk_norm == QkNorm::Whole) {  // OLMoE: the whole projection, before heads
        rmsnorm(qp, qp, L.q_norm, qd, eps);
        rmsnorm(kp, kp, L.k_norm, kvd, eps);
      }
      if (attn.clip_qkv) {  // OLMoE: clamp after the norms, before RoPE
        const float cl = *attn.clip_qkv;
        for (int i = 0; i < qd; ++i) qp[i] = std::clamp(qp[i], -cl, cl);
        for (int i = 0; i < kvd; ++i) kp[i] = std::clamp(kp[i], -cl, cl);
        for (int i = 0; i < kvd; ++i) vp[i] = std::clamp(vp[i], -cl, cl);
      }
      // Partial rotary (GLM-4.5): only the first rotary_dim dims of each head rotate.
      for (int hh = 0; hh < nh; ++hh) rotary.apply(qp + hh * hd, p);
      for (int hh = 0; hh < nkv; ++hh) rotary.apply(kp + hh * hd, p);
    }
    // Causal attention per position and head; GQA: query head hh reads kv head hh / group. A
    // sliding-window layer reads only the last sliding_window keys (the query's own included);
    // with sinks, head hh's sink logit joins the softmax as one more entry that has no value
    // (GptOssAttention's eager_attention_forward).
    for (int p = 0; p < S && attn.kind == AttentionKind::Gqa; ++p) {
      const int first = attn.sliding_window > 0 ? std::max(0, p - attn.sliding_window + 1) : 0;
      const int n = p + 1 - first;
      for (int hh = 0; hh < nh; ++hh) {
        const float* qh = &q[size_t(p) * qd + hh * hd];
        const int kh = hh / group;
        for (int j = first; j <= p; ++j) {
          const float* kj = &k[size_t(j) * kvd + kh * hd];
          float dot = 0.f;
          for (int i = 0; i < hd; ++i) dot += qh[i] * kj[i];
          scores[size_t(j - first)] = dot * scale;
        }
        if (attn.sinks) scores[size_t(n)] = wt(L.sinks, hh);
        softmax(scores.data(), n + (attn.sinks ? 1 : 0));
        float* out = &att[size_t(hh) * hd];
        for (int i = 0; i < hd; ++i) out[i] = 0.f;
        for (int j = first; j <= p; ++j) {
          const float* vj = &v[size_t(j) * kvd + kh * hd];
          for (int i = 0; i < hd; ++i) out[i] += scores[size_t(j - first)] * vj[i];
        }
      }
      if (attn.output_gate)
        for (int i = 0; i < qd; ++i) att[size_t(i)] *= sigmoid(gate[size_t(p) * qd + i]);
      matvec(L.o, att.data(), delta.data());
      if (attn.o_bias) add_bias(delta.data(), L.o_bias, H);
      for (int i = 0; i < H; ++i) x[size_t(p) * H + i] += delta[size_t(i)];
    }
    // (x was updated in place per position: the attention of later positions reads only the
    // q, k, v computed before the loop.)

    // --- FFN: dense, or the routed experts ---
    for (int p = 0; p < S; ++p) {
      float* xp = &x[size_t(p) * H];
      rmsnorm(h.data(), xp, L.post_norm, H, eps, zc);
      if (!L.moe) {
        ffn(L.dense, h.data(), delta.data(), g, u);
      } else {
        // Router: softmax over all E experts in fp32, or each expert's sigmoid. A logit bias
        // (GPT-OSS) is added first; its top-k-then-softmax router reports the full softmax too
        // (same order as the logits), but weighs with a softmax over the chosen logits only.
        float* probs = &r.router_probs[(size_t(p) * Lm + col) * E];
        matvec(L.router, h.data(), probs);
        if (c.router.logit_bias) add_bias(probs, L.router_bias, E);
        std::copy(probs, probs + E, logits.begin());
        if (sigmoid_router)
          for (int e = 0; e < E; ++e) probs[e] = sigmoid(probs[e]);
        else
          softmax(probs, E);

        int16_t* chosen = &r.routes[(size_t(p) * Lm + col) * K];
        const int16_t* forced = p < replay_rows ? replay + (size_t(p) * Lm + col) * K : nullptr;
        if (forced && forced[0] != -1) {  // check_replay: a valid row, keep its order
          for (int kk = 0; kk < K; ++kk) chosen[kk] = forced[kk];
        } else if (sigmoid_router) {
          sigmoid_choice(c.router, probs, L.router_bias, E, K, chosen);
        } else if (c.router.scoring == RouterScoring::TopkSoftmax) {
          argmax_k(logits.data(), E, nullptr, K, chosen);  // own top-k of the logits
        } else {
          argmax_k(probs, E, nullptr, K, chosen);  // own top-k
        }
        // Gate weights: the full softmax (or the unbiased sigmoid scores) gathered at the chosen
        // ids (never a re-softmax), renormalised as the architecture does, then scaled.
        std::vector<float> gate(K);
        float sum = 0.f;
        for (int kk = 0; kk < K; ++kk) {
          gate[size_t(kk)] = probs[chosen[kk]];
          sum += gate[size_t(kk)];
        }
        if (c.router.scoring == RouterScoring::TopkSoftmax) {
          for (int kk = 0; kk < K; ++kk) gate[size_t(kk)] = logits[size_t(chosen[kk])];
          softmax(gate.data(), K);
        }
        if (renorm)
          for (int kk = 0; kk < K; ++kk) gate[size_t(kk)] /= sigmoid_router ? sum + 1e-20f : sum;
        for (int kk = 0; kk < K; ++kk) gate[size_t(kk)] *= c.router.routed_scaling_factor;
        std::copy(gate.begin(), gate.end(), &r.gate_weights[(size_t(p) * Lm + col) * K]);
        // Weighted sum of the experts, accumulated in router (or replayed) order.
        for (int i = 0; i < H; ++i) delta[size_t(i)] = 0.f;
        for (int kk = 0; kk < K; ++kk) {
          ffn(L.experts[size_t(chosen[kk])], h.data(), eo.data(), g, u,
              c.layers[size_t(layer)].activation);
          for (int i = 0; i < H; ++i) delta[size_t(i)] += gate[size_t(kk)] * eo[size_t(i)];
        }
        if (!L.shared.gate.empty()) {  // shared experts, after the routed sum
          ffn(L.shared, h.data(), eo.data(), g, u);
          float sg = 1.f;
          if (!L.shared_gate.empty()) matvec(L.shared_gate, h.data(), &sg), sg = sigmoid(sg);
          for (int i = 0; i < H; ++i) delta[size_t(i)] += sg * eo[size_t(i)];
        }
      }
      for (int i = 0; i < H; ++i) xp[i] += delta[size_t(i)];
    }
    if (L.moe) ++col;
  }

  // Final norm and lm_head (which aliases embed when the embeddings are tied).
  for (int p = 0; p < S; ++p) {
    rmsnorm(h.data(), &x[size_t(p) * H], w.final_norm, H, eps, zc);
    matvec(w.lm_head, h.data(), &r.logits[size_t(p) * V]);
  }
  return r;
}

std::vector<float> log_softmax(const float* logits, int n) {
  std::vector<float> out(size_t(std::max(n, 0)));
  if (n <= 0) return out;
  double mx = logits[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, double(logits[i]));
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int i = 0; i < n; ++i) out[size_t(i)] = float(double(logits[i]) - lse);
  return out;
}

}  // namespace r3
