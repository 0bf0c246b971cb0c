// r3 align, library half (src/staging/rollout_alignment.h): multi-turn engine rollouts staged,
// assembled and replayed through the reference forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/config.h"
#include "staging/rollout_alignment.h"
#include "test_models.h"

namespace r3 {
namespace {

using json = nlohmann::json;
using testing::test_model;

const std::vector<std::string>& kArchs = testing::kAllArchs;

EngineConfig config_for(const std::string& model) {
  EngineConfig c;
  c.model = model;
  c.num_kv_blocks = 128;
  c.threads = 2;
  c.enable_return_routed_experts = true;
  return c;  // prefix caching on: later turns hit the earlier turns' blocks
}

std::vector<RolloutSpec> rollouts_for(const std::string& model, int n, int turns, uint64_t seed,
                                      int max_prompt = 16, int max_user = 8) {
  const ModelConfig mc = load_config(model + "/config.json");
  RandomRolloutOptions o;
  o.num_rollouts = n;
  o.turns = turns;
  o.min_prompt = 6;
  o.max_prompt = max_prompt;
  o.min_user = 3;
  o.max_user = max_user;
  o.seed = seed;
  return random_rollouts(o, mc.vocab_size, mc.bos_token_id, mc.eos_token_id);
}

RolloutAlignmentOptions options(bool repair, Filler filler, int max_tokens = 6, uint64_t seed = 7) {
  RolloutAlignmentOptions o;
  o.repair_boundaries = repair;
  o.filler = filler;
  o.max_tokens = max_tokens;
  o.seed = seed;
  o.trainer_threads = 2;
  return o;
}

std::set<int16_t> expert_set(const RouteArray& r, int row, int layer) {
  std::set<int16_t> s;
  for (int j = 0; j < r.k; ++j) s.insert(r.at(row, layer, j));
  return s;
}

class RolloutAlignmentTiny : public ::testing::TestWithParam<std::string> {};

// Every replayed (token, layer) uses exactly the engine's expert set, so router disagreement
// with replay is exactly zero; an arange filler row forces experts 0..K-1.
TEST_P(RolloutAlignmentTiny, ReplayUsesExactlyTheEngineExpertSets) {
  const std::string model = test_model(GetParam());
  for (Filler filler : {Filler::MinusOne, Filler::Arange}) {
    for (bool repair : {true, false}) {
      SCOPED_TRACE(std::string(filler == Filler::Arange ? "arange" : "minus_one") +
                   (repair ? " repair" : " no repair"));
      const auto rollouts = rollouts_for(model, 3, 3, 11);
      RolloutAlignmentResult r =
          run_rollout_alignment(config_for(model), rollouts, options(repair, filler));
      ASSERT_EQ(r.dropped_rollouts, 0);
      ASSERT_EQ(r.traces.size(), rollouts.size());
      int real_rows = 0;
      for (const auto& t : r.traces) {
        const int S = int(t.tokens.size());
        ASSERT_EQ(t.routes.rows, S);
        ASSERT_EQ(t.trainer_routes_with.rows, S);
        for (int p = 0; p < S; ++p) {
          for (int l = 0; l < t.routes.layers; ++l) {
            const auto used = expert_set(t.trainer_routes_with, p, l);
            if (t.real_route[size_t(p)]) {
              ASSERT_EQ(used, expert_set(t.routes, p, l))
                  << "rollout " << t.index << " position " << p << " layer " << l;
            } else if (filler == Filler::Arange) {
              std::set<int16_t> arange;
              for (int j = 0; j < t.routes.k; ++j) arange.insert(int16_t(j));
              ASSERT_EQ(used, arange) << "filler row at position " << p;
            }
          }
          real_rows += t.real_route[size_t(p)];
        }
      }
      EXPECT_EQ(r.route_rows, real_rows);
      EXPECT_GT(r.route_rows, 0);
      EXPECT_EQ(r.with_replay.router_disagreement_pairs, 0.0);
      EXPECT_EQ(r.with_replay.router_disagreement_tokens, 0.0);
      EXPECT_EQ(r.with_replay.mean_differing_layers, 0.0);
      // Positions line up: engine and trainer logprobs of the same sampled token are close (an
      // off-by-one would be off by nats), both ways.
      EXPECT_EQ(r.tokens, 3 * 3 * 6);
      EXPECT_LT(r.without_replay.max_abs_dlogprob, 0.25);
      if (repair || filler == Filler::MinusOne) {
        EXPECT_LT(r.with_replay.max_abs_dlogprob, 0.25);
      }
      ASSERT_EQ(r.abs_dlogprob_with.size(), size_t(r.tokens));
      ASSERT_EQ(r.abs_dlogprob_without.size(), size_t(r.tokens));
    }
  }
}

// Staged multi-turn rollouts equal the per-position routes of one solo engine run of the final
// full sequence on every non-filler row (the engine is batch-invariant and deterministic, so a
// prefix is routed identically wherever it was computed). With repair only the rollout's last
// token keeps a filler row; without, every call's last token does.
TEST_P(RolloutAlignmentTiny, StagedRoutesEqualSoloRunOfFullSequence) {
  const std::string model = test_model(GetParam());
  const int turns = 3;
  const auto rollouts = rollouts_for(model, 3, turns, 23);
  Engine solo(testing::solo_config(model));
  for (Filler filler : {Filler::MinusOne, Filler::Arange}) {
    for (bool repair : {true, false}) {
      SCOPED_TRACE(std::string(filler == Filler::Arange ? "arange" : "minus_one") +
                   (repair ? " repair" : " no repair"));
      RolloutAlignmentResult r =
          run_rollout_alignment(config_for(model), rollouts, options(repair, filler));
      ASSERT_EQ(r.dropped_rollouts, 0);
      for (const auto& t : r.traces) {
        const int S = int(t.tokens.size());
        ASSERT_EQ(int(t.call_lens.size()), turns);
        ASSERT_EQ(t.call_lens.back(), S);
        SamplingParams sp;
        sp.max_tokens = 1;
        sp.temperature = 0;
        sp.return_routed_experts = true;
        const RequestOutput o = solo.generate({t.tokens}, {sp})[0];
        ASSERT_TRUE(o.routed_experts.has_value()) << o.routes_error;
        const RouteArray& s = *o.routed_experts;
        ASSERT_EQ(s.rows, S);  // S + 1 tokens, last one unrouted
        std::set<int> filler_pos;
        for (size_t i = 0; i < t.call_lens.size(); ++i)
          if (!repair || i + 1 == t.call_lens.size()) filler_pos.insert(t.call_lens[i] - 1);
        for (int p = 0; p < S; ++p) {
          const bool is_filler = filler_pos.count(p) > 0;
          EXPECT_EQ(t.real_route[size_t(p)], !is_filler)
              << "rollout " << t.index << " position " << p;
          for (int l = 0; l < s.layers; ++l)
            for (int j = 0; j < s.k; ++j) {
              const int16_t want = !is_filler                 ? s.at(p, l, j)
                                   : filler == Filler::Arange ? int16_t(j)
                                                              : int16_t(-1);
              ASSERT_EQ(t.routes.at(p, l, j), want)
                  << "rollout " << t.index << " position " << p << " layer " << l;
            }
        }
      }
    }
  }
}

// Repaired boundary rows: one per turn boundary with repair, none without; filler rows the rest.
// Rollouts of different lengths (1, 2 and 4 turns) from the JSONL format.
TEST_P(RolloutAlignmentTiny, RepairedBoundaryCountIsTurnsMinusOne) {
  const std::string model = test_model(GetParam());
  std::istringstream in(
      "{\"prompt_token_ids\":[5,6,7,8,9]}\n"
      "\n"
      "{\"prompt_token_ids\":[10,11,12], \"turns\":[[13,14,15]]}\n"
      "{\"prompt_token_ids\":[20,21,22,23], \"turns\":[[24,25],[26,27,28],[29]]}\n");
  const auto rollouts = read_rollouts_jsonl(in, "inline");
  ASSERT_EQ(rollouts.size(), 3u);
  for (bool repair : {true, false}) {
    SCOPED_TRACE(repair ? "repair" : "no repair");
    RolloutAlignmentResult r =
        run_rollout_alignment(config_for(model), rollouts, options(repair, Filler::MinusOne, 5));
    ASSERT_EQ(r.traces.size(), 3u);
    const int turns[3] = {1, 2, 4};
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(r.traces[size_t(i)].report.repaired_boundary_rows, repair ? turns[i] - 1 : 0);
      EXPECT_EQ(r.traces[size_t(i)].report.filler_rows, repair ? 1 : turns[i]);
    }
    EXPECT_EQ(r.repaired_boundary_rows, repair ? 0 + 1 + 3 : 0);
    EXPECT_EQ(r.filler_rows, repair ? 3 : 1 + 2 + 4);
    EXPECT_EQ(r.tokens, (1 + 2 + 4) * 5);
    // Router rows scored = all positions minus the filler rows.
    int positions = 0;
    for (const auto& t : r.traces) positions += int(t.tokens.size());
    EXPECT_EQ(r.route_rows, positions - r.filler_rows);
  }
}

INSTANTIATE_TEST_SUITE_P(RolloutAlignment, RolloutAlignmentTiny, ::testing::ValuesIn(kArchs),
                         [](const auto& info) { return info.param; });

TEST(RolloutAlignmentJson, HasExactlyTheIssueKeys) {
  const std::string model = test_model("olmoe");
  RolloutAlignmentResult r = run_rollout_alignment(config_for(model), rollouts_for(model, 2, 2, 3),
                                                   options(true, Filler::MinusOne, 4));
  const json j = to_json(r);
  std::set<std::string> top,
      inner_want = {"router_disagreement_pairs", "router_disagreement_tokens",
                    "mean_differing_layers",     "k3_kl",
                    "extreme_token_fraction",    "mean_abs_dlogprob",
                    "max_abs_dlogprob"};
  for (auto it = j.begin(); it != j.end(); ++it) top.insert(it.key());
  EXPECT_EQ(top, (std::set<std::string>{"tokens", "repaired_boundary_rows", "filler_rows",
                                        "without_replay", "with_replay"}));
  for (const char* side : {"without_replay", "with_replay"}) {
    std::set<std::string> inner;
    for (auto it = j[side].begin(); it != j[side].end(); ++it) {
      inner.insert(it.key());
      EXPECT_TRUE(it.value().is_number()) << side << "." << it.key();
    }
    EXPECT_EQ(inner, inner_want) << side;
  }
  EXPECT_EQ(j["tokens"].get<int>(), 2 * 2 * 4);
  EXPECT_EQ(j["repaired_boundary_rows"].get<int>(), 2);
  EXPECT_EQ(j["filler_rows"].get<int>(), 2);
  EXPECT_EQ(j["with_replay"]["router_disagreement_pairs"].get<double>(), 0.0);
  EXPECT_EQ(j["without_replay"]["k3_kl"].get<double>(), r.without_replay.k3_kl);
  const std::string table = format_alignment_table(r);
  for (const char* k : {"router_disagreement_pairs", "k3_kl", "max_abs_dlogprob", "without replay",
                        "with replay", "repaired_boundary_rows", "filler_rows"})
    EXPECT_NE(table.find(k), std::string::npos) << k;
}

TEST(RolloutAlignmentInput, ParsesJsonlAndNamesBadLines) {
  {
    std::istringstream in("{\"prompt_token_ids\":[1,2,3],\"turns\":[[4],[5,6]]}\n");
    auto r = read_rollouts_jsonl(in, "f.jsonl");
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r[0].prompt, (std::vector<int>{1, 2, 3}));
    ASSERT_EQ(r[0].num_turns(), 3);
    EXPECT_EQ(r[0].turns[1], (std::vector<int>{5, 6}));
  }
  auto error_of = [](const std::string& text) {
    std::istringstream in(text);
    try {
      read_rollouts_jsonl(in, "f.jsonl");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of("{\"prompt_token_ids\":[1]}\n{\"prompt\":[1]}\n")
                .find("f.jsonl:2: unknown key \"prompt\""),
            std::string::npos);
  EXPECT_NE(error_of("{\"prompt_token_ids\":[]}\n").find("f.jsonl:1: prompt_token_ids is empty"),
            std::string::npos);
  EXPECT_NE(error_of("{\"prompt_token_ids\":[1],\"turns\":[[]]}").find("turns[0] is empty"),
            std::string::npos);
  EXPECT_NE(error_of("{\"prompt_token_ids\":[1,\"a\"]}").find("prompt_token_ids[1]"),
            std::string::npos);
  EXPECT_NE(error_of("{\"prompt_token_ids\":[-1]}").find("not a valid token id"),
            std::string::npos);
  EXPECT_NE(error_of("{nope").find("f.jsonl:1: malformed JSON"), std::string::npos);
  EXPECT_NE(error_of("{}").find("missing \"prompt_token_ids\""), std::string::npos);
}

TEST(RolloutAlignmentInput, RandomRolloutsAreSeededAndAvoidSpecialTokens) {
  RandomRolloutOptions o;
  o.num_rollouts = 20;
  o.turns = 4;
  o.seed = 5;
  const auto a = random_rollouts(o, 8, 1, 2), b = random_rollouts(o, 8, 1, 2);
  o.seed = 6;
  const auto c = random_rollouts(o, 8, 1, 2);
  ASSERT_EQ(a.size(), 20u);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_EQ(a[i].turns, b[i].turns);
    differs |= a[i].prompt != c[i].prompt;
    EXPECT_EQ(a[i].num_turns(), 4);
    EXPECT_GE(int(a[i].prompt.size()), o.min_prompt);
    EXPECT_LE(int(a[i].prompt.size()), o.max_prompt);
    std::vector<int> all = a[i].prompt;
    for (const auto& u : a[i].turns) {
      EXPECT_GE(int(u.size()), o.min_user);
      EXPECT_LE(int(u.size()), o.max_user);
      all.insert(all.end(), u.begin(), u.end());
    }
    for (int t : all) {
      EXPECT_TRUE(t >= 0 && t < 8 && t != 1 && t != 2) << t;
    }
  }
  EXPECT_TRUE(differs);
}

// The point of r3 align: on the small presets, replaying the engine's routes lowers both the
// router disagreement (to exactly 0) and the k3 KL of the sampled tokens.
class RolloutAlignmentSmall : public ::testing::TestWithParam<std::string> {};

TEST_P(RolloutAlignmentSmall, ReplayLowersRouterDisagreementAndK3) {
  const std::string model = test_model(GetParam(), "small");
  const auto rollouts = rollouts_for(model, 6, 3, 1, 16, 8);
  RolloutAlignmentOptions o = options(true, Filler::MinusOne, 8, 1);
  RolloutAlignmentResult r = run_rollout_alignment(config_for(model), rollouts, o);
  ASSERT_EQ(r.dropped_rollouts, 0);
  EXPECT_EQ(r.tokens, 6 * 3 * 8);
  EXPECT_EQ(r.repaired_boundary_rows, 6 * 2);
  EXPECT_EQ(r.filler_rows, 6);
  EXPECT_GT(r.without_replay.router_disagreement_pairs, 0.0);
  EXPECT_LT(r.with_replay.router_disagreement_pairs, r.without_replay.router_disagreement_pairs);
  EXPECT_LT(r.with_replay.router_disagreement_tokens, r.without_replay.router_disagreement_tokens);
  EXPECT_EQ(r.with_replay.router_disagreement_pairs, 0.0);
  EXPECT_LT(r.with_replay.k3_kl, r.without_replay.k3_kl);
  std::printf(
      "[ %s small ] k3 %.3e -> %.3e, router pairs %.4f -> %.4f, mean |dlogprob| %.3e -> %.3e\n",
      GetParam().c_str(), r.without_replay.k3_kl, r.with_replay.k3_kl,
      r.without_replay.router_disagreement_pairs, r.with_replay.router_disagreement_pairs,
      r.without_replay.mean_abs_dlogprob, r.with_replay.mean_abs_dlogprob);
}

INSTANTIATE_TEST_SUITE_P(RolloutAlignment, RolloutAlignmentSmall, ::testing::ValuesIn(kArchs),
                         [](const auto& info) { return info.param; });

// The CLI end to end on a tiny model: table on stdout, JSON and SVG files.
TEST(RolloutAlignmentCli, AlignWritesTableJsonAndPlot) {
  const std::string model = test_model("olmoe");
  const auto dir =
      std::filesystem::temp_directory_path() / ("r3_align_cli_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string js = (dir / "a.json").string(), svg = (dir / "a.svg").string(),
                    out = (dir / "out.txt").string();
  const std::string cmd = std::string(R3_BINARY) + " align --model " + model +
                          " --num-prompts 2 --turns 2 --max-tokens 4 --threads 2 --json " + js +
                          " --plot " + svg + " > " + out + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream jf(js);
  const json j = json::parse(jf);
  EXPECT_EQ(j["tokens"].get<int>(), 2 * 2 * 4);
  EXPECT_EQ(j["repaired_boundary_rows"].get<int>(), 2);
  EXPECT_TRUE(j["with_replay"].contains("k3_kl"));
  std::stringstream svg_text, out_text;
  svg_text << std::ifstream(svg).rdbuf();
  out_text << std::ifstream(out).rdbuf();
  EXPECT_NE(svg_text.str().find("<svg"), std::string::npos);
  EXPECT_NE(out_text.str().find("router_disagreement_pairs"), std::string::npos) << out_text.str();
  // Both sources of rollouts at once is an error.
  const std::string bad = std::string(R3_BINARY) + " align --model " + model +
                          " --num-prompts 2 --input x.jsonl > " + out + " 2>&1";
  EXPECT_NE(std::system(bad.c_str()), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace r3
