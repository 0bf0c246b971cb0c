// Shared pieces of the engine tests: seeded random workloads with shared prefixes, the solo-run
// oracle, and bitwise comparison of outputs.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace r3::testing {

struct Workload {
  std::vector<std::vector<int>> prompts;
  std::vector<SamplingParams> params;
  std::vector<int> arrival_step;  // step at which the request is added
  std::vector<int> abort_step;    // -1 = never aborted
};

inline Workload make_workload(uint64_t seed, int n, int vocab, double abort_fraction = 0.0) {
  std::mt19937_64 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::vector<int>> bases(3);
  for (auto& b : bases) {
    b.resize(size_t(uni(20, 60)));
    for (auto& t : b) t = uni(3, vocab - 1);
  }
  Workload w;
  for (int i = 0; i < n; ++i) {
    std::vector<int> p;
    if (uni(0, 3) > 0) {
      const auto& b = bases[size_t(uni(0, 2))];
      p.assign(b.begin(), b.begin() + uni(1, int(b.size())));
    }
    const int extra = uni(p.empty() ? 1 : 0, 20);
    for (int j = 0; j < extra; ++j) p.push_back(uni(3, vocab - 1));
    SamplingParams sp;
    sp.max_tokens = uni(1, 24);
    sp.temperature = uni(0, 2) == 0 ? 0.f : 1.f;
    sp.top_p = uni(0, 1) ? 1.f : 0.9f;
    sp.top_k = uni(0, 1) ? 0 : 20;
    sp.seed = rng();
    sp.ignore_eos = uni(0, 1);
    if (uni(0, 4) == 0) sp.stop_token_ids = {uni(3, vocab - 1)};
    sp.return_routed_experts = uni(0, 5) > 0;
    // Half of them with gate weights (from the seed's low bit: no extra draw, so every seeded
    // workload keeps its requests).
    sp.return_routed_expert_weights = sp.return_routed_experts && (sp.seed & 1);
    w.prompts.push_back(p);
    w.params.push_back(sp);
    w.arrival_step.push_back(uni(0, n));
    w.abort_step.push_back(
        std::uniform_real_distribution<double>(0, 1)(rng) < abort_fraction ? uni(0, n + 20) : -1);
  }
  return w;
}

// A small one-thread engine with route capture (num_kv_blocks blocks).
inline EngineConfig small_config(const std::string& model, int num_kv_blocks = 64) {
  EngineConfig c;
  c.model = model;
  c.num_kv_blocks = num_kv_blocks;
  c.threads = 1;
  c.enable_return_routed_experts = true;
  return c;
}

// Greedy, ignoring EOS, routes asked for unless `routes` is false.
inline SamplingParams greedy(int max_tokens, bool routes = true) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.temperature = 0.f;
  p.ignore_eos = true;
  p.return_routed_experts = routes;
  return p;
}

inline EngineConfig solo_config(const std::string& model,
                                const std::string& kv_cache_dtype = "auto") {
  EngineConfig c;
  c.model = model;
  c.kv_cache_dtype = kv_cache_dtype;
  c.enable_prefix_caching = false;
  c.max_num_batched_tokens = 4096;
  c.max_num_seqs = 1;
  c.num_kv_blocks = 64;
  c.enable_return_routed_experts = true;
  return c;
}

// The solo run: alone, no prefix cache, no chunking, no preemption.
inline std::vector<RequestOutput> solo_runs(const std::string& model, const Workload& w,
                                            const std::string& kv_cache_dtype = "auto") {
  Engine e(solo_config(model, kv_cache_dtype));
  std::vector<RequestOutput> out;
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    SamplingParams p = w.params[i];
    p.return_routed_experts = true;
    p.return_routed_expert_weights = true;
    out.push_back(e.generate({w.prompts[i]}, {p})[0]);
  }
  return out;
}

struct RunResult {
  std::vector<RequestOutput> outputs;  // by workload index
  std::vector<bool> aborted;
  EngineStats stats;
};

// Runs the workload with staggered arrivals and aborts on an engine.
inline RunResult run_workload_on(Engine& e, const Workload& w) {
  RunResult r;
  r.outputs.resize(w.prompts.size());
  r.aborted.assign(w.prompts.size(), false);
  std::map<uint64_t, size_t> index;
  std::vector<uint64_t> ids(w.prompts.size(), UINT64_MAX);
  size_t added = 0, finished = 0;
  for (int step = 0; finished < w.prompts.size(); ++step) {
    for (size_t i = 0; i < w.prompts.size(); ++i) {
      if (w.arrival_step[i] == step || (step > 0 && w.arrival_step[i] < 0)) {
        ids[i] = e.add_request(w.prompts[i], w.params[i]);
        index[ids[i]] = i;
        ++added;
      }
      if (w.abort_step[i] == step && ids[i] != UINT64_MAX && e.abort(ids[i])) r.aborted[i] = true;
    }
    for (auto& o : e.step())
      if (o.finished) {
        r.outputs[index.at(o.request_id)] = std::move(o);
        ++finished;
      }
    if (step > 100000) ADD_FAILURE() << "workload did not finish";
  }
  r.stats = e.stats();
  return r;
}

// The same on a fresh engine of the given configuration.
inline RunResult run_workload(const EngineConfig& cfg, const Workload& w) {
  Engine e(cfg);
  return run_workload_on(e, w);
}

// Gate weights: present exactly when asked for, one per id, and bitwise the solo run's from the
// same absolute row on (solo runs carry weights for every row).
inline void expect_weights_match_solo(const RouteArray& g, const RouteArray& solo,
                                      const SamplingParams& p) {
  if (!p.return_routed_expert_weights) {
    EXPECT_FALSE(g.has_weights()) << "weights that were not asked for";
    return;
  }
  ASSERT_EQ(g.weights.size(), g.data.size());
  ASSERT_EQ(solo.weights.size(), solo.data.size());
  const size_t row = size_t(g.layers) * size_t(g.k);
  for (int r = 0; r < g.rows; ++r)
    ASSERT_EQ(0, std::memcmp(g.weights.data() + size_t(r) * row,
                             solo.weights.data() + size_t(r + g.start - solo.start) * row,
                             row * sizeof(float)))
        << "gate weights of row " << r + g.start;
}

// Bitwise: tokens, logprobs, routes (and gate weights) of a finished request equal its solo run's;
// an aborted one's are a prefix of them.
inline void expect_matches_solo(const RequestOutput& got, const RequestOutput& solo, bool aborted,
                                const SamplingParams& p, const std::string& what) {
  SCOPED_TRACE(what);
  if (aborted) {
    EXPECT_EQ(got.finish_reason, "abort");
    ASSERT_LE(got.token_ids.size(), solo.token_ids.size());
    for (size_t i = 0; i < got.token_ids.size(); ++i) {
      EXPECT_EQ(got.token_ids[i], solo.token_ids[i]);
      EXPECT_EQ(got.logprobs[i], solo.logprobs[i]);
    }
    if (p.return_routed_experts) {
      ASSERT_TRUE(got.routed_experts.has_value());
      const RouteArray& g = *got.routed_experts;
      ASSERT_LE(g.rows, solo.routed_experts->rows);
      for (int r = 0; r < g.rows; ++r)
        for (int j = 0; j < g.layers * g.k; ++j)
          ASSERT_EQ(g.row(r)[j], solo.routed_experts->row(r)[j]) << "row " << r;
      expect_weights_match_solo(g, *solo.routed_experts, p);
    }
    return;
  }
  EXPECT_EQ(got.finish_reason, solo.finish_reason);
  EXPECT_EQ(got.token_ids, solo.token_ids);
  ASSERT_EQ(got.logprobs.size(), solo.logprobs.size());
  for (size_t i = 0; i < got.logprobs.size(); ++i)
    EXPECT_EQ(got.logprobs[i], solo.logprobs[i]) << "logprob " << i;
  EXPECT_TRUE(got.routes_error.empty()) << got.routes_error;
  if (!p.return_routed_experts) {
    EXPECT_FALSE(got.routed_experts.has_value());
    return;
  }
  ASSERT_TRUE(got.routed_experts.has_value());
  const RouteArray& g = *got.routed_experts;
  const RouteArray& s = *solo.routed_experts;
  const int S = int(got.prompt_token_ids.size() + got.token_ids.size());
  EXPECT_EQ(g.start, p.routed_experts_start);
  ASSERT_EQ(g.rows, S - 1 - p.routed_experts_start);
  ASSERT_EQ(s.rows, S - 1);
  for (int r = 0; r < g.rows; ++r)
    for (int j = 0; j < g.layers * g.k; ++j) {
      ASSERT_GE(g.row(r)[j], 0) << "missing route at row " << r;
      ASSERT_EQ(g.row(r)[j], s.row(r + g.start)[j]) << "row " << r + g.start;
    }
  expect_weights_match_solo(g, s, p);
}

// The same workload (routes asked for) on two checkpoints holding the same values in different
// layouts (a quantized release and its dequantization): identical tokens, logprobs and routes.
inline void expect_identical_runs(const std::string& model_a, const std::string& model_b,
                                  uint64_t seed, int n) {
  Workload w = make_workload(seed, n, 512, 0.0);
  for (SamplingParams& p : w.params) p.return_routed_experts = true;
  EngineConfig cfg = small_config(model_a, 40);
  cfg.max_num_batched_tokens = 32;
  const RunResult a = run_workload(cfg, w);
  cfg.model = model_b;
  const RunResult b = run_workload(cfg, w);
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    EXPECT_EQ(a.outputs[i].token_ids, b.outputs[i].token_ids) << i;
    EXPECT_EQ(a.outputs[i].logprobs, b.outputs[i].logprobs) << i;
    ASSERT_TRUE(a.outputs[i].routed_experts && b.outputs[i].routed_experts);
    EXPECT_EQ(a.outputs[i].routed_experts->data, b.outputs[i].routed_experts->data) << i;
  }
}

}  // namespace r3::testing
