// The decode attention loop chosen per machine (kernels/attention_choice.h): forced by
// R3_ATTENTION, cached per CPU model, timed otherwise; and whichever loop runs, an engine's
// tokens, logprobs and routes are its solo run's bit for bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "engine_test_util.h"
#include "kernels/attention_choice.h"
#include "test_models.h"

namespace r3 {
namespace {

using kernels::AttentionChoice;
using kernels::choose_decode_attention;
using kernels::DecodeAttention;
using namespace testing;

TEST(AttentionChoice, ForcedCachedOrTimedOnce) {
  const DecodeAttention before = kernels::decode_attention();
  const std::string dir = ::testing::TempDir() + "/r3_attention_" + std::to_string(getpid());
  const std::string cache = dir + "/r3/attention.json";
  std::filesystem::remove_all(dir);
  EXPECT_EQ(choose_decode_attention(cache, "per_head").loop, DecodeAttention::PerHead);
  EXPECT_EQ(kernels::decode_attention(), DecodeAttention::PerHead);
  EXPECT_EQ(choose_decode_attention(cache, "heads").source, "R3_ATTENTION");
  EXPECT_THROW(choose_decode_attention(cache, "fastest"), Error);
  const AttentionChoice first = choose_decode_attention(cache, nullptr);
  EXPECT_EQ(first.source.rfind("timed on ", 0), 0u) << first.source;
  EXPECT_GT(first.heads_gb_per_s, 0);
  EXPECT_GT(first.per_head_gb_per_s, 0);
  EXPECT_EQ(first.loop, first.per_head_gb_per_s > 1.05 * first.heads_gb_per_s
                            ? DecodeAttention::PerHead
                            : DecodeAttention::Heads);
  const AttentionChoice again = choose_decode_attention(cache, nullptr);
  EXPECT_EQ(again.source.rfind("cached for ", 0), 0u) << again.source;
  EXPECT_EQ(again.loop, first.loop);
  std::ofstream(cache) << "{not json";
  EXPECT_EQ(choose_decode_attention(cache, nullptr).source.rfind("timed on ", 0), 0u);
  std::filesystem::remove_all(dir);
  kernels::set_decode_attention(before);
}

// Solo runs under one loop, batched runs (staggered arrivals, prefix hits, small pools) under
// the other: GQA, and GPT-OSS's sinks and sliding windows.
TEST(AttentionChoice, EitherLoopGivesTheSoloRunsBits) {
  const DecodeAttention before = kernels::decode_attention();
  for (const std::string arch : {"olmoe", "gpt_oss"})
    for (DecodeAttention solo_loop : {DecodeAttention::Heads, DecodeAttention::PerHead}) {
      const std::string model = test_model(arch);
      const Workload w = make_workload(arch == "olmoe" ? 31 : 32, 10, 500);
      kernels::set_decode_attention(solo_loop);
      const std::vector<RequestOutput> solo = solo_runs(model, w);
      kernels::set_decode_attention(solo_loop == DecodeAttention::Heads ? DecodeAttention::PerHead
                                                                        : DecodeAttention::Heads);
      const RunResult run = run_workload(small_config(model, 48), w);
      for (size_t i = 0; i < w.prompts.size(); ++i)
        expect_matches_solo(run.outputs[i], solo[i], run.aborted[i], w.params[i],
                            arch + " request " + std::to_string(i) + ", solo loop " +
                                kernels::decode_attention_name(solo_loop));
    }
  kernels::set_decode_attention(before);
}

}  // namespace
}  // namespace r3
