// Tests of the reference forward (src/reference): against a second, deliberately different
// implementation written here (double precision, whole-sequence matrices, full Q K^T, routing by
// std::sort, its own config.json and safetensors reading), plus the routes contract and replay.
#include "reference/reference_forward.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "core/error.h"
#include "model/checkpoint.h"
#include "model/make_model.h"
#include "model/safetensors.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using r3::DType;
using r3::ReferenceResult;
using Mat = std::vector<std::vector<double>>;  // [rows][cols]

// Logits agree to this relative tolerance: max |ref - naive| <= kRelTol * max |naive|. Both
// read the same weight values; only fp32 vs double rounding differs (observed ~1e-6).
constexpr double kRelTol = 1e-4;

// ------------------------------------------------------------------------------------------
// Checkpoints: made once per test binary under a private temp dir, removed at exit.

struct Models {
  fs::path root = fs::temp_directory_path() / ("r3_ref_test_" + std::to_string(::getpid()));
  std::map<std::string, std::shared_ptr<r3::Checkpoint>> open;

  Models() {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ~Models() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }

  // A make_model checkpoint; `patch` is merged into its config.json (a tagged copy).
  std::string dir(const std::string& arch, const std::string& preset, DType dt,
                  const json& patch = json::object()) {
    std::string name = arch + "_" + preset + "_" + r3::dtype_name(dt);
    if (!patch.empty()) name += "_" + std::to_string(std::hash<std::string>{}(patch.dump()));
    fs::path d = root / name;
    if (!fs::exists(d / "config.json")) {
      r3::make_model({.arch = arch, .preset = preset, .seed = 7, .dtype = dt, .out = d.string()});
      if (!patch.empty()) {
        std::ifstream in(d / "config.json");
        json cfg = json::parse(in);
        cfg.merge_patch(patch);
        std::ofstream(d / "config.json") << cfg.dump(2);
      }
    }
    return d.string();
  }

  const r3::ModelWeights& weights(const std::string& dir) {
    auto& ck = open[dir];
    if (!ck) ck = r3::Checkpoint::open(dir);
    return ck->weights();
  }
};

Models& models() {
  static Models m;
  return m;
}

std::vector<int> make_tokens(int S, int V, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<int> t(static_cast<size_t>(S));
  for (auto& x : t) x = int(gen() % unsigned(V));
  return t;
}

Mat zeros(int rows, int cols) {
  return Mat(static_cast<size_t>(rows), std::vector<double>(static_cast<size_t>(cols), 0.0));
}

// ------------------------------------------------------------------------------------------
// The naive implementation: everything in double, whole-sequence matrices.

class Naive {
 public:
  struct Out {
    std::vector<float> logits, probs;  // [S, V], [S, L_moe, E]
    std::vector<int16_t> routes;       // [S, L_moe, K]
  };

  explicit Naive(const std::string& dir) {
    std::ifstream in(fs::path(dir) / "config.json");
    json c = json::parse(in);
    arch_ = c["architectures"][0].get<std::string>();
    H_ = c["hidden_size"];
    V_ = c["vocab_size"];
    nh_ = c["num_attention_heads"];
    nkv_ = c.value("num_key_value_heads", nh_);
    hd_ = c.contains("head_dim") ? c["head_dim"].get<int>() : H_ / nh_;
    layers_ = c["num_hidden_layers"];
    mixtral_ = arch_ == "MixtralForCausalLM";
    qwen2_ = arch_ == "Qwen2MoeForCausalLM";
    shared_ = qwen2_ && c.value("shared_expert_intermediate_size", 0) > 0;
    gpt_oss_ = arch_ == "GptOssForCausalLM";
    E_ = mixtral_ || gpt_oss_ ? c["num_local_experts"].get<int>() : c["num_experts"].get<int>();
    if (gpt_oss_) {
      window_ = c.value("sliding_window", 0);
      limit_ = c.value("swiglu_limit", 7.0);
      for (int i = 0; i < c["num_hidden_layers"].get<int>(); ++i)
        sliding_.push_back(c["layer_types"][size_t(i)] == "sliding_attention");
    }
    K_ = c["num_experts_per_tok"];
    eps_ = c["rms_norm_eps"];
    theta_ = c["rope_theta"];
    renorm_ = mixtral_ || c.value("norm_topk_prob", false);
    tied_ = c.value("tie_word_embeddings", false);
    if (arch_ == "OlmoeForCausalLM" && c.contains("clip_qkv") && !c["clip_qkv"].is_null())
      clip_ = c["clip_qkv"].get<double>();
    for (int i = 0; i < layers_; ++i) {
      bool moe = true;
      if (arch_ == "Qwen3MoeForCausalLM" || qwen2_) {
        auto only = c.value("mlp_only_layers", std::vector<int>{});
        moe = std::find(only.begin(), only.end(), i) == only.end() &&
              (i + 1) % c.value("decoder_sparse_step", 1) == 0;
      }
      moe_.push_back(moe);
    }
    for (auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") {
        for (const r3::TensorToWrite& t : r3::read_safetensors(e.path().string()))
          w_[t.name] = r3::view_of(t).to_f32();
      }
  }

  int num_moe_layers() const { return int(std::count(moe_.begin(), moe_.end(), true)); }

  // `replay`: [rows, L_moe, K]; an all -1 row (or no row) routes by this model's own top-k.
  Out forward(const std::vector<int>& tok, const std::vector<int16_t>& replay = {}) const {
    const int S = int(tok.size()), Lm = num_moe_layers();
    const int replay_rows = int(replay.size()) / (Lm * K_);
    Out out;
    out.probs.assign(size_t(S) * Lm * E_, 0.f);
    out.routes.assign(size_t(S) * Lm * K_, -1);
    const auto& emb = w("model.embed_tokens.weight");
    Mat X = zeros(S, H_);
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < H_; ++i) X[size_t(s)][size_t(i)] = emb[size_t(tok[size_t(s)]) * H_ + i];

    int col = 0;
    for (int l = 0; l < layers_; ++l) {
      const std::string P = "model.layers." + std::to_string(l) + ".";
      Mat h = rmsnorm_rows(X, w(P + "input_layernorm.weight"), H_);
      Mat Q = linear(h, P + "self_attn.q_proj.weight");
      Mat Kt = linear(h, P + "self_attn.k_proj.weight");
      Mat Vt = linear(h, P + "self_attn.v_proj.weight");
      if (qwen2_ || gpt_oss_) {  // q/k/v biases
        add_bias(Q, P + "self_attn.q_proj.bias");
        add_bias(Kt, P + "self_attn.k_proj.bias");
        add_bias(Vt, P + "self_attn.v_proj.bias");
      }
      if (arch_ == "Qwen3MoeForCausalLM") {  // per-head norms, one weight of [head_dim]
        Q = rmsnorm_rows(Q, w(P + "self_attn.q_norm.weight"), hd_);
        Kt = rmsnorm_rows(Kt, w(P + "self_attn.k_norm.weight"), hd_);
      } else if (arch_ == "OlmoeForCausalLM") {  // one norm over the whole projection
        Q = rmsnorm_rows(Q, w(P + "self_attn.q_norm.weight"), nh_ * hd_);
        Kt = rmsnorm_rows(Kt, w(P + "self_attn.k_norm.weight"), nkv_ * hd_);
      }
      if (clip_)
        for (Mat* m : {&Q, &Kt, &Vt})
          for (auto& row : *m)
            for (auto& v : row) v = std::min(std::max(v, -*clip_), *clip_);
      rotate(Q);
      rotate(Kt);

      // Full S x S score matrix per head, causal mask as -inf, row softmax, then P V.
      Mat O = zeros(S, nh_ * hd_);
      for (int hq = 0; hq < nh_; ++hq) {
        const int hk = hq * nkv_ / nh_;
        Mat A = zeros(S, S);
        for (int i = 0; i < S; ++i)
          for (int j = 0; j < S; ++j) {
            double d = 0;
            for (int t = 0; t < hd_; ++t)
              d += Q[size_t(i)][size_t(hq * hd_ + t)] * Kt[size_t(j)][size_t(hk * hd_ + t)];
            // GPT-OSS sliding layers: keys j > i - sliding_window only.
            const bool seen = j <= i && !(gpt_oss_ && sliding_[size_t(l)] && j <= i - window_);
            A[size_t(i)][size_t(j)] = seen ? d / std::sqrt(double(hd_)) : -INFINITY;
          }
        if (gpt_oss_) {  // the head's sink joins each softmax as one more logit, then is dropped
          const double sink = w(P + "self_attn.sinks")[size_t(hq)];
          for (auto& row : A) {
            row.push_back(sink);
            softmax(row);
            row.pop_back();
          }
        } else {
          for (auto& row : A) softmax(row);
        }
        for (int i = 0; i < S; ++i)
          for (int t = 0; t < hd_; ++t) {
            double acc = 0;
            for (int j = 0; j < S; ++j)
              acc += A[size_t(i)][size_t(j)] * Vt[size_t(j)][size_t(hk * hd_ + t)];
            O[size_t(i)][size_t(hq * hd_ + t)] = acc;
          }
      }
      Mat attn_out = linear(O, P + "self_attn.o_proj.weight");
      if (gpt_oss_) add_bias(attn_out, P + "self_attn.o_proj.bias");
      add(X, attn_out);

      h = rmsnorm_rows(X, w(P + "post_attention_layernorm.weight"), H_);
      if (!moe_[size_t(l)]) {
        add(X, mlp(h, P + "mlp.gate_proj.weight", P + "mlp.up_proj.weight",
                   P + "mlp.down_proj.weight"));
        continue;
      }
      const std::string R = mixtral_   ? P + "block_sparse_moe.gate.weight"
                            : gpt_oss_ ? P + "mlp.router.weight"
                                       : P + "mlp.gate.weight";
      Mat logits = linear(h, R);
      if (gpt_oss_) add_bias(logits, P + "mlp.router.bias");
      Mat moe_out = zeros(S, H_);
      for (int s = 0; s < S; ++s) {
        std::vector<double> p = logits[size_t(s)];
        softmax(p);
        for (int e = 0; e < E_; ++e)
          out.probs[(size_t(s) * Lm + col) * E_ + e] = float(p[size_t(e)]);
        std::vector<int> ids(static_cast<size_t>(E_));
        std::iota(ids.begin(), ids.end(), 0);
        std::sort(ids.begin(), ids.end(), [&](int a, int b) {
          return p[size_t(a)] != p[size_t(b)] ? p[size_t(a)] > p[size_t(b)] : a < b;
        });
        ids.resize(size_t(K_));
        if (s < replay_rows && replay[(size_t(s) * Lm + col) * K_] != -1)
          for (int k = 0; k < K_; ++k) ids[size_t(k)] = replay[(size_t(s) * Lm + col) * K_ + k];
        double total = 0;
        for (int id : ids) total += p[size_t(id)];
        Mat hs{h[size_t(s)]};
        // GPT-OSS (GptOssTopKRouter): the weights are a softmax over the chosen logits.
        std::vector<double> chosen_logits;
        for (int id : ids) chosen_logits.push_back(logits[size_t(s)][size_t(id)]);
        softmax(chosen_logits);
        for (int k = 0; k < K_ && gpt_oss_; ++k) {
          const int e = ids[size_t(k)];
          out.routes[(size_t(s) * Lm + col) * K_ + k] = int16_t(e);
          const std::vector<double> y = gpt_oss_expert(hs[0], P, e);
          for (int i = 0; i < H_; ++i)
            moe_out[size_t(s)][size_t(i)] += chosen_logits[size_t(k)] * y[size_t(i)];
        }
        for (int k = 0; k < K_ && !gpt_oss_; ++k) {
          const int e = ids[size_t(k)];
          out.routes[(size_t(s) * Lm + col) * K_ + k] = int16_t(e);
          const double gw = renorm_ ? p[size_t(e)] / total : p[size_t(e)];
          const std::string X3 = mixtral_
                                     ? P + "block_sparse_moe.experts." + std::to_string(e) + "."
                                     : P + "mlp.experts." + std::to_string(e) + ".";
          Mat y = mixtral_ ? mlp(hs, X3 + "w1.weight", X3 + "w3.weight", X3 + "w2.weight")
                           : mlp(hs, X3 + "gate_proj.weight", X3 + "up_proj.weight",
                                 X3 + "down_proj.weight");
          for (int i = 0; i < H_; ++i) moe_out[size_t(s)][size_t(i)] += gw * y[0][size_t(i)];
        }
        if (shared_) {  // Qwen2-MoE: + sigmoid(shared_expert_gate . h) * shared_expert(h)
          const double g =
              1.0 / (1.0 + std::exp(-linear(hs, P + "mlp.shared_expert_gate.weight")[0][0]));
          Mat y =
              mlp(hs, P + "mlp.shared_expert.gate_proj.weight",
                  P + "mlp.shared_expert.up_proj.weight", P + "mlp.shared_expert.down_proj.weight");
          for (int i = 0; i < H_; ++i) moe_out[size_t(s)][size_t(i)] += g * y[0][size_t(i)];
        }
      }
      add(X, moe_out);
      ++col;
    }
    Mat hf = rmsnorm_rows(X, w("model.norm.weight"), H_);
    Mat lg = linear(hf, tied_ ? "model.embed_tokens.weight" : "lm_head.weight");
    for (auto& row : lg)
      for (double v : row) out.logits.push_back(float(v));
    return out;
  }

 private:
  const std::vector<float>& w(const std::string& name) const {
    auto it = w_.find(name);
    if (it == w_.end()) throw std::runtime_error("naive: no tensor " + name);
    return it->second;
  }

  // A W^T for W stored [out, in].
  Mat linear(const Mat& A, const std::string& name) const {
    const auto& W = w(name);
    const size_t in = A[0].size(), outd = W.size() / in;
    Mat Y(A.size(), std::vector<double>(outd));
    for (size_t s = 0; s < A.size(); ++s)
      for (size_t o = 0; o < outd; ++o) {
        double acc = 0;
        for (size_t i = 0; i < in; ++i) acc += double(W[o * in + i]) * A[s][i];
        Y[s][o] = acc;
      }
    return Y;
  }

  // GptOssExperts for one token and expert e, from the fused tensors as stored: gate_up =
  // h @ gate_up_proj[e] + bias ([E, H, 2I], inputs first), gate = [::2], up = [1::2], gate
  // clamped above and up both ways at swiglu_limit, (up + 1) * gate * sigmoid(1.702 gate), then
  // @ down_proj[e] ([E, I, H]) + bias.
  std::vector<double> gpt_oss_expert(const std::vector<double>& h, const std::string& P,
                                     int e) const {
    const auto& gu = w(P + "mlp.experts.gate_up_proj");
    const auto& gub = w(P + "mlp.experts.gate_up_proj_bias");
    const auto& dn = w(P + "mlp.experts.down_proj");
    const auto& dnb = w(P + "mlp.experts.down_proj_bias");
    const size_t I2 = gub.size() / size_t(E_), I = I2 / 2, H = size_t(H_);
    std::vector<double> act(I), y(H);
    for (size_t i = 0; i < I; ++i) {
      double g = gub[size_t(e) * I2 + 2 * i], u = gub[size_t(e) * I2 + 2 * i + 1];
      for (size_t k = 0; k < H; ++k) {
        g += h[k] * gu[(size_t(e) * H + k) * I2 + 2 * i];
        u += h[k] * gu[(size_t(e) * H + k) * I2 + 2 * i + 1];
      }
      g = std::min(g, limit_);
      u = std::min(std::max(u, -limit_), limit_);
      act[i] = (u + 1) * g / (1 + std::exp(-1.702 * g));
    }
    for (size_t o = 0; o < H; ++o) {
      double acc = dnb[size_t(e) * H + o];
      for (size_t i = 0; i < I; ++i) acc += act[i] * dn[(size_t(e) * I + i) * H + o];
      y[o] = acc;
    }
    return y;
  }

  void add_bias(Mat& A, const std::string& name) const {
    const auto& b = w(name);
    for (auto& row : A)
      for (size_t i = 0; i < row.size(); ++i) row[i] += b[i];
  }

  Mat mlp(const Mat& h, const std::string& gate, const std::string& up,
          const std::string& down) const {
    Mat g = linear(h, gate), u = linear(h, up);
    for (size_t s = 0; s < g.size(); ++s)
      for (size_t i = 0; i < g[s].size(); ++i)
        g[s][i] = g[s][i] / (1 + std::exp(-g[s][i])) * u[s][i];
    return linear(g, down);
  }

  // Normalises every `group`-wide slice of each row with the weight (of length `group`).
  Mat rmsnorm_rows(Mat A, const std::vector<float>& wt, int group) const {
    for (auto& row : A)
      for (size_t g0 = 0; g0 < row.size(); g0 += size_t(group)) {
        double ss = 0;
        for (int i = 0; i < group; ++i) ss += row[g0 + size_t(i)] * row[g0 + size_t(i)];
        const double inv = 1 / std::sqrt(ss / group + eps_);
        for (int i = 0; i < group; ++i) row[g0 + size_t(i)] *= inv * wt[size_t(i)];
      }
    return A;
  }

  // RoPE rotate-half on every head of every row; row index = position.
  void rotate(Mat& A) const {
    const int half = hd_ / 2;
    for (size_t pos = 0; pos < A.size(); ++pos)
      for (size_t h0 = 0; h0 < A[pos].size(); h0 += size_t(hd_))
        for (int i = 0; i < half; ++i) {
          const double ang = double(pos) * std::pow(theta_, -2.0 * i / hd_);
          const double a = A[pos][h0 + size_t(i)], b = A[pos][h0 + size_t(i + half)];
          A[pos][h0 + size_t(i)] = a * std::cos(ang) - b * std::sin(ang);
          A[pos][h0 + size_t(i + half)] = b * std::cos(ang) + a * std::sin(ang);
        }
  }

  static void softmax(std::vector<double>& x) {
    const double mx = *std::max_element(x.begin(), x.end());
    double sum = 0;
    for (auto& v : x) sum += (v = std::exp(v - mx));
    for (auto& v : x) v /= sum;
  }

  static void add(Mat& X, const Mat& D) {
    for (size_t s = 0; s < X.size(); ++s)
      for (size_t i = 0; i < X[s].size(); ++i) X[s][i] += D[s][i];
  }

  std::string arch_;
  int H_ = 0, V_ = 0, nh_ = 0, nkv_ = 0, hd_ = 0, layers_ = 0, E_ = 0, K_ = 0;
  double eps_ = 0, theta_ = 0;
  bool mixtral_ = false, renorm_ = false, tied_ = false, qwen2_ = false, shared_ = false,
       gpt_oss_ = false;
  int window_ = 0;
  double limit_ = 7.0;
  std::vector<bool> sliding_;
  std::optional<double> clip_;
  std::vector<bool> moe_;
  std::map<std::string, std::vector<float>> w_;
};

double max_abs(const std::vector<float>& a) {
  double m = 0;
  for (float v : a) m = std::max(m, double(std::fabs(v)));
  return m;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

// Relative logits error of `r` against the naive output, and identical routes.
void expect_matches_naive(const ReferenceResult& r, const Naive::Out& n) {
  ASSERT_EQ(r.logits.size(), n.logits.size());
  const double rel = max_abs_diff(r.logits, n.logits) / max_abs(n.logits);
  std::ostringstream err;
  err << std::scientific << rel;
  ::testing::Test::RecordProperty("logits_rel_err", err.str());  // observed ~1e-6
  EXPECT_LE(rel, kRelTol) << "logits differ from the naive forward";
  EXPECT_LE(max_abs_diff(r.router_probs, n.probs), 1e-5) << "router probabilities differ";
  EXPECT_EQ(r.routes, n.routes) << "routes differ from the naive forward";
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ------------------------------------------------------------------------------------------
// 1. Against the naive forward.

struct Case {
  const char* name;
  const char* arch;
  const char* preset;
  DType dtype;
  json patch;  // merged into config.json
  int seq_len;
};

class ReferenceVsNaive : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceVsNaive, LogitsAndRoutesMatch) {
  const Case& c = GetParam();
  std::string dir = models().dir(c.arch, c.preset, c.dtype, c.patch);
  const auto& w = models().weights(dir);
  Naive naive(dir);
  auto tok = make_tokens(c.seq_len, w.config.vocab_size, 11);
  ReferenceResult r = r3::reference_forward(w, tok);
  expect_matches_naive(r, naive.forward(tok));
}

const Case kCases[] = {
    // GQA 4 heads / 2 kv heads; Mixtral always renormalises.
    {"mixtral_tiny_bf16", "mixtral", "tiny", DType::BF16, json::object(), 48},
    {"mixtral_tiny_f32", "mixtral", "tiny", DType::F32, json::object(), 48},
    // Tied embeddings (no lm_head.weight), per-head q/k norm, norm_topk_prob true.
    {"qwen3_tiny_bf16", "qwen3_moe", "tiny", DType::BF16, json::object(), 48},
    {"qwen3_tiny_f32_no_norm_topk",
     "qwen3_moe",
     "tiny",
     DType::F32,
     {{"norm_topk_prob", false}},
     48},
    // Dense layer 0 (mlp_only_layers [0]), GQA 8 / 4, top-8 of 32 experts, two shards.
    {"qwen3_small_bf16_dense_layer", "qwen3_moe", "small", DType::BF16, json::object(), 40},
    // q/k/v biases, a shared expert behind its sigmoid gate, no renormalisation.
    {"qwen2_tiny_bf16", "qwen2_moe", "tiny", DType::BF16, json::object(), 48},
    // Dense layer 0, renormalised top-8 of 32, f32 weights.
    {"qwen2_small_f32_dense_layer_norm_topk",
     "qwen2_moe",
     "small",
     DType::F32,
     {{"norm_topk_prob", true}},
     40},
    // clip_qkv 8 (does not bind) and 0.5 (binds); whole-projection q/k norm; no renormalisation.
    {"olmoe_tiny_bf16_clip8", "olmoe", "tiny", DType::BF16, json::object(), 48},
    {"olmoe_tiny_f32_clip_half", "olmoe", "tiny", DType::F32, {{"clip_qkv", 0.5}}, 48},
    {"olmoe_tiny_bf16_norm_topk", "olmoe", "tiny", DType::BF16, {{"norm_topk_prob", true}}, 48},
    {"mixtral_small_bf16", "mixtral", "small", DType::BF16, json::object(), 32},
    // Sinks, sliding window 8 on even layers (the sequence slides past it), q/k/v/o biases,
    // biased top-k-then-softmax router, fused biased experts with the clamped SwiGLU.
    {"gpt_oss_tiny_bf16", "gpt_oss", "tiny", DType::BF16, json::object(), 40},
    {"gpt_oss_tiny_f32_window3_limit1",
     "gpt_oss",
     "tiny",
     DType::F32,
     {{"sliding_window", 3}, {"swiglu_limit", 1.0}},
     40},
};

INSTANTIATE_TEST_SUITE_P(Reference, ReferenceVsNaive, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The config variants above must change the output, or matching the naive forward on them would
// prove nothing.
TEST(ReferenceForward, ConfigVariantsChangeTheOutput) {
  auto tok = make_tokens(24, 512, 3);
  auto run = [&](const char* arch, json patch) {
    return r3::reference_forward(models().weights(models().dir(arch, "tiny", DType::F32, patch)),
                                 tok);
  };
  auto q_norm = run("qwen3_moe", json::object()),
       q_raw = run("qwen3_moe", {{"norm_topk_prob", false}});
  EXPECT_GT(max_abs_diff(q_norm.logits, q_raw.logits), 1e-3) << "norm_topk_prob has no effect";
  auto o_clip8 = run("olmoe", json::object()), o_clip = run("olmoe", {{"clip_qkv", 0.5}});
  auto o_none = run("olmoe", {{"clip_qkv", nullptr}});
  EXPECT_GT(max_abs_diff(o_clip8.logits, o_clip.logits), 1e-3) << "clip_qkv 0.5 has no effect";
  EXPECT_TRUE(bitwise_equal(o_clip8.logits, o_none.logits)) << "clip_qkv 8 should not bind";
}

// ------------------------------------------------------------------------------------------
// 2. The routes contract: [S, L_moe, K], valid distinct ids, descending router order.

TEST(ReferenceForward, RoutesShapeAndRouterOrder) {
  for (auto [arch, preset] : {std::pair{"mixtral", "tiny"},
                              {"qwen3_moe", "tiny"},
                              {"olmoe", "tiny"},
                              {"qwen3_moe", "small"}}) {
    SCOPED_TRACE(std::string(arch) + "/" + preset);
    const auto& w = models().weights(models().dir(arch, preset, DType::BF16));
    const auto& cfg = w.config;
    const int S = 20;
    ReferenceResult r = r3::reference_forward(w, make_tokens(S, cfg.vocab_size, 5));
    const int L = cfg.num_moe_layers(), K = cfg.top_k, E = cfg.num_experts;
    EXPECT_EQ(
        L, std::string(preset) == "small" && std::string(arch) == "qwen3_moe" ? 3 : cfg.num_layers);
    ASSERT_EQ(r.seq_len, S);
    ASSERT_EQ(r.vocab, cfg.vocab_size);
    ASSERT_EQ(r.num_moe_layers, L);
    ASSERT_EQ(r.top_k, K);
    ASSERT_EQ(r.num_experts, E);
    ASSERT_EQ(r.logits.size(), size_t(S) * cfg.vocab_size);
    ASSERT_EQ(r.routes.size(), size_t(S) * L * K);
    ASSERT_EQ(r.router_probs.size(), size_t(S) * L * E);
    for (int p = 0; p < S; ++p)
      for (int l = 0; l < L; ++l) {
        const int16_t* row = &r.routes[(size_t(p) * L + l) * K];
        const float* pr = &r.router_probs[(size_t(p) * L + l) * E];
        double sum = 0;
        for (int e = 0; e < E; ++e) sum += pr[e];
        EXPECT_NEAR(sum, 1.0, 1e-5);
        std::set<int> ids;
        for (int k = 0; k < K; ++k) {
          ASSERT_GE(row[k], 0);
          ASSERT_LT(row[k], E);
          ids.insert(row[k]);
          if (k > 0) {  // descending probability, ties to the lower id
            EXPECT_GE(pr[row[k - 1]], pr[row[k]]) << "position " << p << " layer " << l;
            if (pr[row[k - 1]] == pr[row[k]]) {
              EXPECT_LT(row[k - 1], row[k]);
            }
          }
        }
        EXPECT_EQ(ids.size(), size_t(K)) << "duplicate ids at position " << p << " layer " << l;
        for (int e = 0; e < E; ++e)  // no unchosen expert beats the last chosen one
          if (!ids.count(e)) {
            EXPECT_LE(pr[e], pr[row[K - 1]]);
          }
      }
  }
}

// Exact ties: a copy of the f32 tiny Mixtral whose layer-0 router rows are all equal (every
// expert ties) and whose layer-1 rows 4 and 6 equal row 2. Ties must go to the lower id.
TEST(ReferenceForward, RouterTiesGoToTheLowerExpertId) {
  fs::path src = models().dir("mixtral", "tiny", DType::F32);
  fs::path dst = models().root / "mixtral_tiny_ties";
  fs::create_directories(dst);
  fs::copy_file(src / "config.json", dst / "config.json", fs::copy_options::overwrite_existing);
  {
    std::vector<r3::TensorToWrite> out;
    for (const r3::TensorToWrite& stored :
         r3::read_safetensors((src / "model.safetensors").string())) {
      const std::string& name = stored.name;
      const r3::TensorView t = r3::view_of(stored);
      ASSERT_EQ(t.dtype, DType::F32);
      std::vector<float> v = t.to_f32();
      const int64_t H = t.shape.size() == 2 ? t.shape[1] : 0;
      if (name == "model.layers.0.block_sparse_moe.gate.weight")
        for (int64_t e = 1; e < t.shape[0]; ++e) std::copy_n(&v[0], H, &v[size_t(e * H)]);
      if (name == "model.layers.1.block_sparse_moe.gate.weight")
        for (int64_t e : {4, 6}) std::copy_n(&v[size_t(2 * H)], H, &v[size_t(e * H)]);
      r3::TensorToWrite w{name, t.dtype, t.shape, std::vector<uint8_t>(v.size() * 4)};
      std::memcpy(w.bytes.data(), v.data(), w.bytes.size());
      out.push_back(std::move(w));
    }
    r3::write_safetensors((dst / "model.safetensors").string(), out);
  }
  const auto& w = models().weights(dst.string());
  const int S = 48, L = 2, K = 2;
  auto tok = make_tokens(S, w.config.vocab_size, 29);
  ReferenceResult r = r3::reference_forward(w, tok);
  int tied_group_chosen = 0;
  for (int p = 0; p < S; ++p) {
    const int16_t* l0 = &r.routes[size_t(p) * L * K];
    EXPECT_EQ(l0[0], 0) << "position " << p;  // all eight tie: experts 0 then 1
    EXPECT_EQ(l0[1], 1) << "position " << p;
    const int16_t* l1 = l0 + K;
    auto has = [&](int e) { return l1[0] == e || l1[1] == e; };
    tied_group_chosen += has(2);
    EXPECT_FALSE(has(4) && !has(2)) << "position " << p << ": 4 chosen over its twin 2";
    EXPECT_FALSE(has(6)) << "position " << p << ": 6 chosen over its twins 2 and 4";
    if (has(2) && has(4)) {
      EXPECT_EQ(l1[0], 2);
    }
  }
  EXPECT_GT(tied_group_chosen, 0)
      << "the tied experts were never in the top-k: the test is vacuous";
  expect_matches_naive(r, Naive(dst.string()).forward(tok));
}

// ------------------------------------------------------------------------------------------
// 3. Replay.

TEST(ReferenceForward, ReplayOfOwnRoutesIsBitIdentical) {
  for (auto [arch, preset] : {std::pair{"mixtral", "tiny"},
                              {"qwen3_moe", "tiny"},
                              {"olmoe", "tiny"},
                              {"qwen3_moe", "small"},
                              {"qwen2_moe", "tiny"},
                              {"glm4_moe", "tiny"},
                              {"glm4_moe", "small"},
                              {"deepseek_v3", "tiny"},
                              {"deepseek_v3", "small"},
                              {"gpt_oss", "tiny"},
                              {"gpt_oss", "small"}}) {
    SCOPED_TRACE(std::string(arch) + "/" + preset);
    const auto& w = models().weights(models().dir(arch, preset, DType::BF16));
    auto tok = make_tokens(24, w.config.vocab_size, 9);
    ReferenceResult own = r3::reference_forward(w, tok);
    ReferenceResult rep = r3::reference_forward(w, tok, own.routes.data(), own.seq_len);
    EXPECT_TRUE(bitwise_equal(own.logits, rep.logits));
    EXPECT_EQ(own.routes, rep.routes);
    EXPECT_TRUE(bitwise_equal(own.router_probs, rep.router_probs));
  }
}

// Sigmoid routers (GLM-4.5): e_score_correction_bias chooses, never weighs. With the same routes
// replayed, a different bias gives bit-identical logits; left to its own router, the model then
// picks other experts.
TEST(ReferenceForward, SelectionBiasNeverEntersAGateWeight) {
  const auto& w = models().weights(models().dir("glm4_moe", "small", DType::BF16));
  ASSERT_EQ(w.config.router.scoring, r3::RouterScoring::Sigmoid);
  auto tok = make_tokens(24, w.config.vocab_size, 17);
  ReferenceResult own = r3::reference_forward(w, tok);
  r3::ModelWeights shifted = w;
  std::vector<std::vector<float>> biases;
  for (auto& L : shifted.layers) {
    if (L.router_bias.empty()) continue;
    std::vector<float> b(static_cast<size_t>(w.config.num_experts));
    for (size_t e = 0; e < b.size(); ++e)
      b[e] = L.router_bias.at(int64_t(e)) + (e % 3 == 0 ? 0.3f : -0.2f);
    biases.push_back(std::move(b));
    L.router_bias.data = biases.back().data();
    L.router_bias.dtype = DType::F32;
  }
  ReferenceResult replayed = r3::reference_forward(shifted, tok, own.routes.data(), own.seq_len);
  EXPECT_EQ(replayed.routes, own.routes);
  EXPECT_TRUE(bitwise_equal(replayed.logits, own.logits)) << "the bias changed a gate weight";
  ReferenceResult free_run = r3::reference_forward(shifted, tok);
  EXPECT_NE(free_run.routes, own.routes) << "the bias changed no choice: the test is vacuous";
}

// Row (p, l) holds the router's own top-k: descending probability, nothing unchosen above it.
bool is_own_top_k(const ReferenceResult& r, int p, int l) {
  const int L = r.num_moe_layers, K = r.top_k, E = r.num_experts;
  const int16_t* row = &r.routes[(size_t(p) * L + l) * K];
  const float* pr = &r.router_probs[(size_t(p) * L + l) * E];
  for (int k = 1; k < K; ++k)
    if (pr[row[k - 1]] < pr[row[k]]) return false;
  for (int e = 0; e < E; ++e)
    if (std::find(row, row + K, e) == row + K && pr[e] > pr[row[K - 1]]) return false;
  return true;
}

// The K least likely experts, in descending id order (so the forced order is not router order).
std::vector<int16_t> least_likely(const ReferenceResult& r, int rows) {
  const int L = r.num_moe_layers, K = r.top_k, E = r.num_experts;
  std::vector<int16_t> out(static_cast<size_t>(rows) * L * K);
  for (int p = 0; p < rows; ++p)
    for (int l = 0; l < L; ++l) {
      const float* pr = &r.router_probs[(size_t(p) * L + l) * E];
      std::vector<int> ids(static_cast<size_t>(E));
      std::iota(ids.begin(), ids.end(), 0);
      std::sort(ids.begin(), ids.end(),
                [&](int a, int b) { return pr[a] != pr[b] ? pr[a] < pr[b] : a < b; });
      ids.resize(size_t(K));
      std::sort(ids.rbegin(), ids.rend());
      for (int k = 0; k < K; ++k) out[(size_t(p) * L + l) * K + k] = int16_t(ids[size_t(k)]);
    }
  return out;
}

TEST(ReferenceForward, ReplayOfOtherExpertsIsForcedAndMatchesNaive) {
  // Mixtral renormalises, OLMoE does not, Qwen3 small has a dense layer and norm_topk_prob,
  // GPT-OSS weighs with a softmax over the forced ids' biased logits.
  for (auto [arch, preset] : {std::pair{"mixtral", "tiny"},
                              {"olmoe", "tiny"},
                              {"qwen3_moe", "small"},
                              {"gpt_oss", "tiny"}}) {
    SCOPED_TRACE(std::string(arch) + "/" + preset);
    std::string dir = models().dir(arch, preset, DType::BF16);
    const auto& w = models().weights(dir);
    Naive naive(dir);
    const int S = 24;
    auto tok = make_tokens(S, w.config.vocab_size, 13);
    ReferenceResult own = r3::reference_forward(w, tok);

    // Every row forced.
    auto forced = least_likely(own, S);
    ReferenceResult rep = r3::reference_forward(w, tok, forced.data(), S);
    EXPECT_EQ(rep.routes, forced) << "reported routes must be the forced ones, in forced order";
    EXPECT_GT(max_abs_diff(rep.logits, own.logits), 1e-2)
        << "forcing other experts changed nothing";
    expect_matches_naive(rep, naive.forward(tok, forced));

    // Only the first half forced: later rows route by the (now different) own router.
    const int half = S / 2;
    std::vector<int16_t> first(forced.begin(),
                               forced.begin() + ptrdiff_t(half) * own.num_moe_layers * own.top_k);
    // The buffer still holds S forced rows; those past replay_rows must be ignored.
    ReferenceResult part = r3::reference_forward(w, tok, forced.data(), half);
    EXPECT_TRUE(std::equal(first.begin(), first.end(), part.routes.begin()));
    for (int p = half; p < S; ++p)
      for (int l = 0; l < part.num_moe_layers; ++l)
        EXPECT_TRUE(is_own_top_k(part, p, l))
            << "row past replay_rows was replayed: position " << p;
    expect_matches_naive(part, naive.forward(tok, first));
  }
}

TEST(ReferenceForward, AllMinusOneRowsUseTheOwnRouter) {
  const auto& w = models().weights(models().dir("qwen3_moe", "tiny", DType::BF16));
  const int S = 24;
  auto tok = make_tokens(S, w.config.vocab_size, 17);
  ReferenceResult own = r3::reference_forward(w, tok);
  const size_t row = size_t(own.num_moe_layers) * own.top_k;

  std::vector<int16_t> none(size_t(S) * row, -1);
  ReferenceResult a = r3::reference_forward(w, tok, none.data(), S);
  EXPECT_TRUE(bitwise_equal(own.logits, a.logits));
  EXPECT_EQ(own.routes, a.routes);

  // Mixed: -1 rows in a checkerboard over (position, MoE layer), own routes elsewhere; plus a
  // short replay.
  std::vector<int16_t> mixed = own.routes;
  const int K = own.top_k;
  for (int p = 0; p < S; ++p)
    for (int l = 0; l < own.num_moe_layers; ++l)
      if ((p + l) % 2)
        std::fill_n(mixed.begin() + ptrdiff_t((p * own.num_moe_layers + l) * K), K, int16_t(-1));
  ReferenceResult b = r3::reference_forward(w, tok, mixed.data(), S);
  EXPECT_TRUE(bitwise_equal(own.logits, b.logits));
  EXPECT_EQ(own.routes, b.routes);
  ReferenceResult c = r3::reference_forward(w, tok, mixed.data(), 5);
  EXPECT_TRUE(bitwise_equal(own.logits, c.logits));
}

// Expects an r3::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, std::vector<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no r3::Error thrown";
  } catch (const r3::Error& e) {
    for (auto& s : parts) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  }
}

TEST(ReferenceForward, MalformedReplayRowsThrowNamingPositionAndLayer) {
  const auto& w = models().weights(models().dir("olmoe", "tiny", DType::BF16));
  const int S = 12, L = w.config.num_moe_layers(), K = w.config.top_k, E = w.config.num_experts;
  ASSERT_EQ(K, 2);
  auto tok = make_tokens(S, w.config.vocab_size, 19);
  std::vector<int16_t> good = r3::reference_forward(w, tok).routes;
  auto with_row = [&](std::vector<int16_t> row) {  // position 5, MoE layer 1
    std::vector<int16_t> rep = good;
    std::copy(row.begin(), row.end(), rep.begin() + ptrdiff_t((5 * L + 1) * K));
    return rep;
  };
  for (auto [row, why] : {std::pair{std::vector<int16_t>{-1, 3}, "partly -1"},
                          {std::vector<int16_t>{3, -1}, "partly -1"},
                          {std::vector<int16_t>{4, 4}, "duplicate"},
                          {std::vector<int16_t>{1, int16_t(E)}, "outside"},
                          {std::vector<int16_t>{-2, 1}, "outside"}}) {
    SCOPED_TRACE(why);
    auto rep = with_row(row);
    expect_error([&] { r3::reference_forward(w, tok, rep.data(), S); },
                 {"position 5", "MoE layer 1", why});
  }
  // More rows than tokens, and a token outside the vocabulary.
  expect_error([&] { r3::reference_forward(w, tok, good.data(), S + 1); }, {"rows"});
  auto bad_tok = tok;
  bad_tok[3] = w.config.vocab_size;
  expect_error([&] { r3::reference_forward(w, bad_tok); }, {"position 3"});
}

// ------------------------------------------------------------------------------------------
// 4. The presets' routers are not degenerate: choices vary across tokens and across layers.

TEST(ReferenceForward, RouterChoicesVaryAcrossTokensAndLayers) {
  for (auto [arch, preset] : {std::pair{"mixtral", "tiny"},
                              {"qwen3_moe", "tiny"},
                              {"olmoe", "tiny"},
                              {"qwen3_moe", "small"},
                              {"olmoe", "small"}}) {
    SCOPED_TRACE(std::string(arch) + "/" + preset);
    const auto& w = models().weights(models().dir(arch, preset, DType::BF16));
    const int S = 32;
    ReferenceResult r = r3::reference_forward(w, make_tokens(S, w.config.vocab_size, 23));
    const int L = r.num_moe_layers, K = r.top_k, E = r.num_experts;
    auto set_at = [&](int p, int l) {
      const int16_t* row = &r.routes[(size_t(p) * L + l) * K];
      return std::set<int>(row, row + K);
    };
    for (int l = 0; l < L; ++l) {
      std::set<std::set<int>> sets;
      std::set<int> used;
      double top1 = 0;
      for (int p = 0; p < S; ++p) {
        sets.insert(set_at(p, l));
        for (int e : set_at(p, l)) used.insert(e);
        top1 += r.router_probs[(size_t(p) * L + l) * E + r.routes[(size_t(p) * L + l) * K]];
      }
      EXPECT_GE(sets.size(), size_t(S / 4)) << "layer " << l << ": few distinct top-k sets";
      EXPECT_GE(used.size(), size_t(std::min(E, S * K) / 2))
          << "layer " << l << ": few experts used";
      // Neither saturated (one expert takes everything) nor flat (uniform scores).
      EXPECT_LT(top1 / S, 0.9) << "layer " << l;
      EXPECT_GT(top1 / S, 1.5 / E) << "layer " << l;
    }
    for (int l = 1; l < L; ++l) {
      int differ = 0;
      for (int p = 0; p < S; ++p) differ += set_at(p, l) != set_at(p, l - 1);
      EXPECT_GE(differ, S / 2) << "layers " << l - 1 << " and " << l << " route alike";
    }
  }
}

// ------------------------------------------------------------------------------------------

TEST(ReferenceForward, LogSoftmaxIsStableAndNormalised) {
  std::vector<float> x = {1000.f, 1001.f, 999.5f, -1000.f, 0.f};
  auto y = r3::log_softmax(x.data(), int(x.size()));
  ASSERT_EQ(y.size(), x.size());
  long double m = 1001.0L, s = 0;
  for (float v : x) s += std::exp((long double)v - m);
  double total = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(std::isfinite(y[i]));
    EXPECT_NEAR(y[i], double((long double)x[i] - m - std::log(s)), 1e-4);
    total += std::exp(double(y[i]));
  }
  EXPECT_NEAR(total, 1.0, 1e-6);
}

}  // namespace
