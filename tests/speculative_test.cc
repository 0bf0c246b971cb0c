// Speculative decoding (NGRAM): the drafter on its own, then the engine's promise that drafts
// change speed only: tokens, logprobs, top logprobs, weight versions and routes (with gate
// weights) bit-identical to the solo run without speculation, under seeded random schedules
// (prefix hits, preemption, chunked prefill, EPLB, aborts, streamed routes), greedy and sampled,
// on every architecture (the Gated DeltaNet hybrids' recurrent state undone past rejected
// drafts); and no route row of a rejected draft ever returned.
#include <gtest/gtest.h>

#include <random>

#include "core/error.h"
#include "engine/ngram_drafter.h"
#include "engine_test_util.h"
#include "test_models.h"

namespace r3::testing {
namespace {

std::vector<int> draft_of(const std::vector<int>& t, int max_drafts, NgramDraftConfig cfg = {}) {
  std::vector<int> out;
  ngram_draft(t.data(), int(t.size()), cfg, max_drafts, out);
  return out;
}

TEST(NgramDraft, TheMostRecentMatchOfTheLongestWindowWins) {
  // Tail [7 8]: it occurs after 1 (followed by 5 6) and later after 2 (followed by 9 4): the most
  // recent occurrence wins.
  EXPECT_EQ(draft_of({1, 7, 8, 5, 6, 2, 7, 8, 9, 4, 7, 8}, 3), (std::vector<int>{9, 4, 7}));
  // A longer window beats a more recent shorter one: [3 7 8] occurs only at the start.
  EXPECT_EQ(draft_of({3, 7, 8, 1, 2, 0, 7, 8, 4, 3, 7, 8}, 2), (std::vector<int>{1, 2}));
  // Drafts stop where the tokens end and at max_drafts.
  EXPECT_EQ(draft_of({5, 6, 5}, 4), (std::vector<int>{6, 5}));
  EXPECT_EQ(draft_of({5, 6, 5, 6, 5}, 1), (std::vector<int>{6}));
  EXPECT_TRUE(draft_of({5, 6, 5}, 0).empty());
  // No earlier occurrence of any window: nothing.
  EXPECT_TRUE(draft_of({1, 2, 3, 4}, 4).empty());
  EXPECT_TRUE(draft_of({9}, 4).empty());
  EXPECT_TRUE(draft_of({}, 4).empty());
  // The smallest window counts: with min 2 a single repeated token is not a match.
  NgramDraftConfig two;
  two.min_window = 2;
  EXPECT_TRUE(draft_of({4, 1, 2, 4}, 3, two).empty());
  EXPECT_EQ(draft_of({4, 1, 2, 4}, 3), (std::vector<int>{1, 2, 4}));
  // Matches are searched only within the lookback.
  NgramDraftConfig near;
  near.max_lookback = 4;
  EXPECT_TRUE(draft_of({4, 1, 0, 0, 0, 0, 4}, 1, near).empty());
  EXPECT_EQ(draft_of({4, 1, 0, 0, 0, 0, 4}, 1), (std::vector<int>{1}));
}

TEST(NgramDraft, AgreesWithABruteForceSearchOnRandomTokens) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = int(rng() % 40), V = 2 + int(rng() % 4), K = 1 + int(rng() % 5);
    std::vector<int> t(static_cast<size_t>(n));
    for (int& x : t) x = int(rng() % uint64_t(V));
    NgramDraftConfig cfg;
    cfg.min_window = 1 + int(rng() % 2);
    cfg.max_window = cfg.min_window + int(rng() % 4);
    std::vector<int> want;
    for (int w = std::min(cfg.max_window, n - 1); w >= cfg.min_window && want.empty(); --w)
      for (int s = n - w - 1; s >= 0 && want.empty(); --s)
        if (std::equal(t.end() - w, t.end(), t.begin() + s))
          want.assign(t.begin() + s + w, t.begin() + std::min(n, s + w + K));
    ASSERT_EQ(draft_of(t, K, cfg), want) << "trial " << trial;
  }
}

// Prompts whose outputs drafts can predict: half repeat a stretch of themselves, so n-gram
// matches exist from the first decode on (tiny random models also fall into loops).
Workload speculative_workload(uint64_t seed, int n) {
  Workload w = make_workload(seed, n, 512, 0.1);
  std::mt19937_64 rng(seed ^ 0x5bd1e995);
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    std::vector<int>& p = w.prompts[i];
    if (rng() % 2 && p.size() >= 4) {
      const std::vector<int> copy = p;
      p.insert(p.end(), copy.begin(), copy.end());
    }
    SamplingParams& sp = w.params[i];
    sp.max_tokens = 4 + int(rng() % 28);
    if (rng() % 3 == 0) sp.top_logprobs = 1 + int(rng() % 3);
  }
  return w;
}

EngineConfig speculative_config(const std::string& model, int k) {
  EngineConfig cfg;
  cfg.model = model;
  cfg.block_size = 16;
  cfg.num_kv_blocks = 16;           // a few requests' worth: forces preemption
  cfg.max_num_batched_tokens = 24;  // forces chunked prefill
  cfg.max_num_seqs = 6;
  cfg.enable_return_routed_experts = true;
  cfg.speculative_algorithm = "NGRAM";
  cfg.speculative_num_draft_tokens = k;
  cfg.speculative_disable_by_batch_size = 4;
  return cfg;
}

void expect_same_scoring(const RequestOutput& got, const RequestOutput& solo, bool aborted,
                         const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_LE(got.token_ids.size(), solo.token_ids.size());
  ASSERT_EQ(got.weight_versions.size(), got.token_ids.size());
  ASSERT_EQ(got.top_logprobs.size(), got.token_ids.size() * (got.top_logprobs.empty() ? 0 : 1));
  for (size_t i = 0; i < got.top_logprobs.size(); ++i) {
    const TopLogprobs &a = got.top_logprobs[i], &b = solo.top_logprobs[i];
    ASSERT_EQ(a.n, b.n) << "top logprobs of token " << i;
    for (int j = 0; j < a.n; ++j) {
      EXPECT_EQ(a.ids[j], b.ids[j]);
      EXPECT_EQ(a.logprobs[j], b.logprobs[j]);
    }
  }
  if (!aborted) {
    EXPECT_EQ(got.weight_versions, solo.weight_versions);
  }
}

struct Case {
  std::string arch;
  int k;
  bool eplb;
};

std::string name_of(const ::testing::TestParamInfo<Case>& i) {
  return i.param.arch + "_k" + std::to_string(i.param.k) + (i.param.eplb ? "_eplb" : "");
}

class EngineSpeculative : public ::testing::TestWithParam<Case> {};

TEST_P(EngineSpeculative, BitIdenticalToSoloRunsWithoutSpeculation) {
  const Case c = GetParam();
  const std::string model = test_model(c.arch);
  const Workload w = speculative_workload(31 + uint64_t(c.k), 40);
  const std::vector<RequestOutput> solo = solo_runs(model, w);  // without speculation
  EngineConfig cfg = speculative_config(model, c.k);
  if (c.eplb) cfg.eplb_redundant_experts = 3;
  const RunResult r = run_workload(cfg, w);
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    expect_matches_solo(r.outputs[i], solo[i], r.aborted[i], w.params[i],
                        "request " + std::to_string(i));
    expect_same_scoring(r.outputs[i], solo[i], r.aborted[i], "request " + std::to_string(i));
  }
  // Speculation really happened, drafts were both accepted and rejected, and the schedule's
  // features were exercised beside it.
  // (The hybrids' tiny models seldom repeat themselves, so their n-gram drafts are rarely right:
  // EngineSpeculativeOracle accepts drafts on them.)
  EXPECT_GT(r.stats.spec_draft_tokens, 0u);
  if (!is_hybrid(c.arch)) {
    EXPECT_GT(r.stats.spec_accepted_tokens, 0u);
  }
  EXPECT_LT(r.stats.spec_accepted_tokens, r.stats.spec_draft_tokens);
  EXPECT_GT(r.stats.spec_steps_off, 0u);  // more than 4 decoding at once: drafting paused
  EXPECT_GT(r.stats.preemptions, 0u);
  EXPECT_GT(r.stats.prefix_hit_tokens, 0u);
  EXPECT_GT(r.stats.chunked_prefills, 0u);
  EXPECT_EQ(r.stats.routed_experts_gaps, 0u);
  EXPECT_EQ(r.stats.stale_prefix_rows, 0u);
  EXPECT_EQ(r.stats.free_blocks, r.stats.num_blocks);  // nothing leaked
  EXPECT_EQ(r.stats.free_window_blocks, r.stats.num_window_blocks);
  if (is_hybrid(c.arch)) {
    // Prefix hits restored recurrent-state snapshots, and rejected drafts' states were undone
    // from the states kept after each draft.
    EXPECT_GT(r.stats.state_snapshot_restores, 0u);
    EXPECT_EQ(r.stats.spec_draft_state_bytes, uint64_t(cfg.speculative_disable_by_batch_size) *
                                                  uint64_t(c.k) *
                                                  r.stats.recurrent_state_bytes_per_request);
  } else {
    EXPECT_EQ(r.stats.spec_draft_state_bytes, 0u);
  }
}

std::vector<Case> speculative_cases() {
  std::vector<Case> out;
  int i = 0;
  for (const std::string& arch : kAllArchs) out.push_back({arch, 2 + (i * 5) % 6, i % 2 == 1}), ++i;
  return out;
}

INSTANTIATE_TEST_SUITE_P(Tiny, EngineSpeculative, ::testing::ValuesIn(speculative_cases()),
                         name_of);

// Drafts that are right up to a random point: an oracle drafter proposes the solo run's next
// tokens with one of them changed half the time, so every step accepts some drafts and rejects
// the rest. Hybrids then undo their recurrent state to the last accepted draft step after step
// (their tiny models' own outputs rarely repeat, so n-gram drafts are seldom right there).
class EngineSpeculativeOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineSpeculativeOracle, PartlyRightDraftsChangeNothing) {
  const std::string arch = GetParam();
  const std::string model = test_model(arch);
  const Workload w = speculative_workload(77, 40);
  const std::vector<RequestOutput> solo = solo_runs(model, w);
  std::map<std::pair<std::vector<int>, uint64_t>, std::vector<int>> solo_tokens;
  for (size_t i = 0; i < w.prompts.size(); ++i)
    solo_tokens[{w.prompts[i], w.params[i].seed}] = solo[i].token_ids;
  EngineConfig cfg = speculative_config(model, 4);
  cfg.speculative_disable_by_batch_size = 6;  // every step drafts (max_num_seqs 6)
  cfg.num_kv_blocks = 12;                     // preemption
  Engine e(cfg);
  const int vocab = e.model_config().vocab_size;
  uint64_t changed = 0;
  e.set_drafter([&](const Request& r, int max_drafts, std::vector<int>& out) {
    const std::vector<int>& next = solo_tokens.at({r.prompt, r.params.seed});
    const size_t from = r.output.size();
    for (size_t i = from; i < next.size() && int(out.size()) < max_drafts; ++i)
      out.push_back(next[i]);
    std::mt19937_64 rng(r.id * 1000003 + from);
    if (!out.empty() && rng() % 2) {
      const size_t at = rng() % out.size();
      out[at] = (out[at] + 1) % vocab;
      ++changed;
    }
  });
  const RunResult r = run_workload_on(e, w);
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    expect_matches_solo(r.outputs[i], solo[i], r.aborted[i], w.params[i],
                        "request " + std::to_string(i));
    expect_same_scoring(r.outputs[i], solo[i], r.aborted[i], "request " + std::to_string(i));
  }
  EXPECT_GT(changed, 10u);
  EXPECT_GT(r.stats.spec_accepted_tokens, r.stats.spec_draft_tokens / 4);
  EXPECT_LT(r.stats.spec_accepted_tokens, r.stats.spec_draft_tokens);
  // (Preemption under speculation: EngineSpeculative, which forces it on every family.)
  EXPECT_GT(r.stats.prefix_hit_tokens, 0u);
  EXPECT_EQ(r.stats.free_blocks, r.stats.num_blocks);
  if (is_hybrid(arch)) {
    EXPECT_GT(r.stats.state_snapshot_restores, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, EngineSpeculativeOracle,
                         ::testing::Values("qwen3_next", "qwen3_5_moe", "deepseek_v3", "gpt_oss",
                                           "qwen3_moe"));

// A request drafts one token more than its last step accepted, up to K: drafts that are always
// right grow 1, 2, 3, 4, 4, ...; drafts that are always wrong stay at one token.
TEST(EngineSpeculativeConfig, DraftsGrowWithWhatTheLastStepAccepted) {
  const std::string model = test_model("olmoe");
  const std::vector<int> prompt = {3, 4, 5, 6, 7};
  const SamplingParams sp = greedy(20);
  const std::vector<int> want = Engine(solo_config(model)).generate({prompt}, {sp})[0].token_ids;
  for (bool right : {true, false}) {
    Engine e(speculative_config(model, 4));
    std::vector<int> asked;
    e.set_drafter([&](const Request& r, int max_drafts, std::vector<int>& out) {
      asked.push_back(max_drafts);
      for (size_t i = r.output.size(); i < want.size() && int(out.size()) < max_drafts; ++i)
        out.push_back(right ? want[i] : (want[i] + 1) % 64);
    });
    EXPECT_EQ(e.generate({prompt}, {sp})[0].token_ids, want);
    ASSERT_GE(asked.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(asked[i], right ? int(i) + 1 : 1) << i;
    if (right) {
      EXPECT_EQ(asked[3], 4);
    }
  }
}

TEST(EngineSpeculativeConfig, SetDrafterNeedsSpeculationAndCutsBadTokens) {
  const std::string model = test_model("olmoe");
  Engine plain(solo_config(model));
  EXPECT_THROW(plain.set_drafter([](const Request&, int, std::vector<int>&) {}), Error);
  Engine e(speculative_config(model, 4));
  // Out-of-vocabulary tokens (and more than asked) are cut, never computed.
  e.set_drafter([](const Request&, int max_drafts, std::vector<int>& out) {
    out = {5, 6, -1, 7, 8, 9, 10, 11, 12};
  });
  const RequestOutput got = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
  const RequestOutput want = Engine(solo_config(model)).generate({{3, 4, 5, 6}}, {greedy(6)})[0];
  expect_matches_solo(got, want, false, greedy(6), "cut drafts");
  EXPECT_GT(e.stats().spec_draft_tokens, 0u);
  EXPECT_LE(e.stats().spec_draft_tokens, 2u * e.stats().steps);  // at most {5, 6} a step
  e.generate({{3, 4}}, {greedy(1)});
}

// Streamed routes and aborted requests read the rows computed so far (assemble_computed): a row
// a rejected draft wrote would show up there as a row past the request's tokens. Every chunk
// must hold exactly the rows of the tokens before its newest, bitwise the solo run's.
TEST(EngineSpeculativeRoutes, NoRowOfARejectedDraftIsEverReturned) {
  const std::string model = test_model("qwen3_moe");
  std::mt19937_64 rng(11);
  std::vector<std::vector<int>> prompts;
  for (int i = 0; i < 6; ++i) {
    // Few distinct tokens: short matches everywhere, so drafts are often wrong.
    std::vector<int> p(size_t(12 + rng() % 20));
    for (int& t : p) t = 3 + int(rng() % 8);
    prompts.push_back(p);
  }
  SamplingParams sp = greedy(40);
  sp.stream_routes = true;
  sp.return_routed_expert_weights = true;
  // Greedy and sampled: a tiny model's greedy output soon loops, so its drafts are all right;
  // sampled ones get rejected.
  std::vector<SamplingParams> params(prompts.size(), sp);
  for (size_t i = 0; i < params.size(); i += 2) params[i].temperature = 1.f, params[i].seed = i;
  std::vector<RequestOutput> solo;
  {
    Engine e(solo_config(model));
    for (size_t i = 0; i < prompts.size(); ++i)
      solo.push_back(e.generate({prompts[i]}, {params[i]})[0]);
  }
  EngineConfig cfg = speculative_config(model, 5);
  cfg.num_kv_blocks = 64;
  cfg.speculative_disable_by_batch_size = 8;  // all six draft
  Engine e(cfg);
  std::map<uint64_t, size_t> index;
  std::map<uint64_t, int> next_row;  // the first row the next chunk must start at
  for (size_t i = 0; i < prompts.size(); ++i) index[e.add_request(prompts[i], params[i])] = i;
  size_t finished = 0;
  for (int step = 0; finished < prompts.size(); ++step) {
    if (step == 6) e.abort(0);  // an abort mid-run: its last rows come from assemble_computed
    for (const RequestOutput& o : e.step()) {
      const RouteArray& solo_rows = *solo[index.at(o.request_id)].routed_experts;
      ASSERT_TRUE(o.routed_experts.has_value());
      const RouteArray& g = *o.routed_experts;
      const int tokens = int(o.prompt_token_ids.size() + o.token_ids.size());
      if (o.finished) {
        ++finished;
        EXPECT_EQ(g.start, 0);
        EXPECT_EQ(g.rows, tokens - 1) << "request " << o.request_id << " " << o.finish_reason;
      } else {
        EXPECT_EQ(g.start, next_row[o.request_id]);
        EXPECT_EQ(g.start + g.rows, tokens - 1) << "rows past the newest token's";
        next_row[o.request_id] = g.start + g.rows;
      }
      for (int r = 0; r < g.rows; ++r)
        for (int j = 0; j < g.layers * g.k; ++j)
          ASSERT_EQ(g.row(r)[j], solo_rows.row(r + g.start)[j]) << "row " << r + g.start;
      expect_weights_match_solo(g, solo_rows, sp);
    }
    ASSERT_LT(step, 1000);
  }
  EXPECT_GT(e.stats().spec_accepted_tokens, 0u);
  EXPECT_LT(e.stats().spec_accepted_tokens, e.stats().spec_draft_tokens);
}

// Drafts that are always right: a model-independent check that acceptance emits several tokens a
// step and that max_tokens, stop tokens and the KV rollback hold at the edges (K far above what
// is left to generate).
TEST(EngineSpeculativeRoutes, LimitsHoldWhenDraftsRunPastThem) {
  const std::string model = test_model("mixtral");
  std::vector<int> prompt = {5, 9, 11, 5, 9, 11, 5, 9};
  for (int max_tokens : {1, 2, 3, 7}) {
    SamplingParams sp = greedy(max_tokens);
    Engine solo(solo_config(model));
    const RequestOutput want = solo.generate({prompt}, {sp})[0];
    EngineConfig cfg = speculative_config(model, 16);
    Engine e(cfg);
    // Drafts that are always right and would go on past the end: the engine asks for no more
    // than one per token still to sample after the newest.
    e.set_drafter([&](const Request& r, int max_drafts, std::vector<int>& out) {
      EXPECT_LE(max_drafts, max_tokens - int(r.output.size()) - 1);
      for (int i = 0; i < max_drafts; ++i) {
        const size_t at = r.output.size() + size_t(i);
        out.push_back(at < want.token_ids.size() ? want.token_ids[at] : 7);
      }
    });
    const RequestOutput got = e.generate({prompt}, {sp})[0];
    expect_matches_solo(got, want, false, sp, "max_tokens " + std::to_string(max_tokens));
    EXPECT_EQ(int(got.token_ids.size()), max_tokens);
    if (max_tokens == 7) {
      EXPECT_GT(e.stats().spec_accepted_tokens, 0u);
    }
    // Stop at the first token the solo run emitted at position 1 (if it stops earlier, fine).
    if (want.token_ids.size() >= 2) {
      SamplingParams stop = sp;
      stop.stop_token_ids = {want.token_ids[1]};
      const RequestOutput a = Engine(solo_config(model)).generate({prompt}, {stop})[0];
      const RequestOutput b = Engine(cfg).generate({prompt}, {stop})[0];
      expect_matches_solo(b, a, false, stop, "stop token");
    }
  }
}

// A refit between steps: the tokens after it come from the new weights, exactly as decoding
// without speculation refitted after the same number of tokens (versions, logprobs and routes).
TEST(EngineSpeculativeRoutes, RefitBetweenStepsMatchesDecodingWithoutSpeculation) {
  const std::string a = test_model("olmoe", "tiny", 0), b = test_model("olmoe", "tiny", 1);
  std::vector<int> prompt;
  for (int i = 0; i < 30; ++i) prompt.push_back(3 + (i % 6) * 11);
  const SamplingParams sp = greedy(24);
  // Runs to the end, refitting to b once the output holds at least `at` tokens; returns the
  // output and how many tokens it held at the refit.
  auto run = [&](bool speculate, int at) {
    EngineConfig cfg = speculative_config(a, 4);
    if (!speculate) cfg.speculative_algorithm.clear();
    Engine e(cfg);
    const uint64_t id = e.add_request(prompt, sp);
    int held = -1;
    RequestOutput done;
    while (!done.finished) {
      for (RequestOutput& o : e.step()) {
        if (o.request_id != id) continue;
        if (held < 0 && int(o.token_ids.size()) >= at) {
          held = int(o.token_ids.size());
          e.update_weights(b, false);
        }
        if (o.finished) done = std::move(o);
      }
    }
    if (speculate) {
      EXPECT_GT(e.stats().spec_accepted_tokens, 0u);
    }
    return std::make_pair(done, held);
  };
  const auto [spec, held] = run(true, 6);
  ASSERT_GE(held, 6);
  const auto [want, same] = run(false, held);
  ASSERT_EQ(same, held);
  expect_matches_solo(spec, want, false, sp, "refit after " + std::to_string(held) + " tokens");
  EXPECT_EQ(spec.weight_versions, want.weight_versions);
  EXPECT_EQ(spec.weight_versions.back(), 1u);
}

TEST(EngineSpeculativeConfig, RefusedCombinationsNameThemselves) {
  auto refused = [](EngineConfig cfg, const std::string& needle) {
    try {
      Engine e(cfg);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  EngineConfig cfg = speculative_config(test_model("qwen3_moe"), 4);
  EngineConfig overlap = cfg;
  overlap.overlap_scheduler = true;
  refused(overlap, "overlap scheduler");
  EngineConfig nextn = cfg;
  nextn.speculative_algorithm = "NEXTN";
  refused(nextn, "MTP");
  EngineConfig bad = cfg;
  bad.speculative_algorithm = "ngramz";
  refused(bad, "speculative_algorithm must be NGRAM");
  EngineConfig zero = cfg;
  zero.speculative_num_draft_tokens = 0;
  refused(zero, "speculative_num_draft_tokens");
  EngineConfig window = cfg;
  window.speculative_ngram_min_match_window_size = 5;
  window.speculative_ngram_max_match_window_size = 2;
  refused(window, "min <= max");
}

}  // namespace
}  // namespace r3::testing
