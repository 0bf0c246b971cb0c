// Scoring: prompt-token logprobs (prompt_logprobs_start), the top alternatives of every scored
// and generated position (top_logprobs), and prefill-only requests (max_tokens 0). Oracle: a
// generated token's logprob and a prompt token's logprob in the same context are the same bits
// (batch invariance), whatever the schedule.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "test_models.h"

namespace r3 {
namespace {

using testing::greedy;
using testing::test_model;

EngineConfig config_for(const std::string& model, int batched_tokens = 512, bool overlap = false) {
  EngineConfig c = testing::small_config(model, 128);
  c.max_num_batched_tokens = batched_tokens;
  c.overlap_scheduler = overlap;
  return c;
}

TEST(Scoring, PromptLogprobsEqualTheGeneratedTokensLogprobs) {
  for (const std::string arch : {"olmoe", "qwen3_moe"}) {
    SCOPED_TRACE(arch);
    const std::string model = test_model(arch, "small");
    Engine gen(config_for(model));
    const std::vector<int> a = {5, 17, 99, 3, 250, 41, 7};
    SamplingParams g = greedy(12);
    g.top_logprobs = 5;
    const RequestOutput o = gen.generate({a}, {g})[0];
    ASSERT_EQ(o.top_logprobs.size(), 12u);
    for (size_t i = 0; i < 12; ++i) {
      // Greedy: the best alternative is the sampled token itself, with the same logprob.
      EXPECT_EQ(o.top_logprobs[i].n, 5);
      EXPECT_EQ(o.top_logprobs[i].ids[0], o.token_ids[i]);
      EXPECT_EQ(o.top_logprobs[i].logprobs[0], o.logprobs[i]);
      for (int j = 1; j < 5; ++j)
        EXPECT_LE(o.top_logprobs[i].logprobs[j], o.top_logprobs[i].logprobs[j - 1]);
    }
    std::vector<int> seq = a;
    seq.insert(seq.end(), o.token_ids.begin(), o.token_ids.end());
    // Score the whole sequence as a prompt, prefill only, under several schedules.
    for (int batched : {512, 5, 3}) {
      for (bool overlap : {false, true}) {
        SCOPED_TRACE(std::to_string(batched) + (overlap ? " overlap" : ""));
        Engine e(config_for(model, batched, overlap));
        SamplingParams s = greedy(0);
        s.prompt_logprobs_start = 0;
        s.top_logprobs = 5;
        // A neighbour in the same steps changes nothing.
        const uint64_t other = e.add_request({9, 8, 7, 6, 5, 4}, greedy(7));
        const uint64_t id = e.add_request(seq, s);
        std::map<uint64_t, RequestOutput> done;
        while (e.has_unfinished())
          for (auto& out : e.step())
            if (out.finished) done[out.request_id] = out;
        const RequestOutput& sc = done[id];
        EXPECT_EQ(sc.finish_reason, "length");
        EXPECT_TRUE(sc.token_ids.empty());
        ASSERT_EQ(sc.prompt_logprobs.size(), seq.size());
        EXPECT_TRUE(std::isnan(sc.prompt_logprobs[0]));
        for (size_t i = 0; i < 12; ++i) {
          EXPECT_EQ(sc.prompt_logprobs[a.size() + i], o.logprobs[i]) << i;
          for (int j = 0; j < 5; ++j)
            EXPECT_EQ(sc.prompt_top_logprobs[a.size() + i].ids[j], o.top_logprobs[i].ids[j]);
        }
        // Routes of a prefill-only request: its S-1 rows, equal to the generating run's.
        ASSERT_TRUE(sc.routed_experts);
        ASSERT_EQ(sc.routed_experts->rows, int(seq.size()) - 1);
        for (int r = 0; r < sc.routed_experts->rows; ++r)
          for (int j = 0; j < sc.routed_experts->layers * sc.routed_experts->k; ++j)
            ASSERT_EQ(sc.routed_experts->row(r)[j], o.routed_experts->row(r)[j]) << "row " << r;
        EXPECT_EQ(done[other].token_ids.size(), 7u);
      }
    }
  }
}

TEST(Scoring, StartSkipsEarlierPositionsAndBadValuesAreRefused) {
  Engine e(config_for(test_model("olmoe")));
  SamplingParams s = greedy(2);
  s.prompt_logprobs_start = 3;
  const RequestOutput o = e.generate({{4, 5, 6, 7, 8, 9}}, {s})[0];
  EXPECT_EQ(o.prompt_logprobs_start, 3);
  ASSERT_EQ(o.prompt_logprobs.size(), 3u);  // positions 3, 4, 5
  for (float lp : o.prompt_logprobs) EXPECT_TRUE(std::isfinite(lp) && lp <= 0.f);
  EXPECT_EQ(o.token_ids.size(), 2u);
  s.prompt_logprobs_start = 7;
  EXPECT_THROW(e.add_request({4, 5, 6}, s), Error);
  SamplingParams k = greedy(2);
  k.top_logprobs = 21;
  EXPECT_THROW(e.add_request({4, 5, 6}, k), Error);
}

}  // namespace
}  // namespace r3
