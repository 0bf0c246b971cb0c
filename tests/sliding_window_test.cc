// Sliding-window KV eviction (GPT-OSS's alternating sliding layers): the sliding layers' blocks
// wholly before every later query's window are freed while the request runs, so those layers
// hold a bounded number of blocks however long the sequence; the full layers keep every block
// and the route store every row. (EngineSchedule and EngineFuzz run gpt_oss under random
// schedules with prefix hits and preemption, each request bit-identical to its solo run.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/checkpoint.h"
#include "reference/reference_forward.h"
#include "test_models.h"

namespace r3::testing {
namespace {

EngineConfig long_config(const std::string& model, int chunk) {
  EngineConfig cfg = small_config(model, 128);
  cfg.block_size = 4;
  cfg.max_num_batched_tokens = chunk;
  cfg.max_num_seqs = 4;
  return cfg;
}

// One long request, stepped: the sliding pool never holds more than the window plus one chunk
// (in blocks, with the partial blocks at either end), blocks come back as the window slides,
// and the routes are complete and the logprobs those of the reference forward replaying them.
TEST(SlidingWindow, BlocksAreFreedAsTheWindowSlidesAndRoutesStayComplete) {
  const std::string model = test_model("gpt_oss");
  for (int chunk : {8, 64}) {
    SCOPED_TRACE(chunk);
    Engine e(long_config(model, chunk));
    const ModelConfig& mc = e.model_config();
    const int W = mc.layers[0].attention.sliding_window, bs = 4;
    ASSERT_GT(W, 0);
    std::vector<int> prompt(150);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + int(i * 37 % 400);
    e.add_request(prompt, greedy(60));
    const EngineStats s0 = e.stats();
    ASSERT_GT(s0.num_window_blocks, 0);
    const int bound = (W - 1 + bs - 1) / bs + (chunk + bs - 1) / bs + 2;
    int peak = 0, full_peak = 0;
    RequestOutput out;
    while (e.has_unfinished()) {
      for (RequestOutput& o : e.step())
        if (o.finished) out = std::move(o);
      const EngineStats s = e.stats();
      peak = std::max(peak, s.num_window_blocks - s.free_window_blocks);
      full_peak = std::max(full_peak, s.num_blocks - s.free_blocks);
    }
    EXPECT_LE(peak, bound);
    // The full layers keep every block: seen between steps, the KV of positions 0 .. 207 (the
    // last step computes 208 and finishes, releasing everything).
    EXPECT_EQ(full_peak, (150 + 60 - 2 + bs - 1) / bs);
    const EngineStats end = e.stats();
    EXPECT_EQ(end.free_window_blocks, end.num_window_blocks);
    EXPECT_EQ(end.routed_experts_gaps, 0u);
    ASSERT_TRUE(out.routed_experts);
    EXPECT_EQ(out.routed_experts->rows, 150 + 60 - 1);
    auto ck = Checkpoint::open(model);
    std::vector<int> seq = out.prompt_token_ids;
    seq.insert(seq.end(), out.token_ids.begin(), out.token_ids.end());
    const ReferenceResult ref = reference_forward(
        ck->weights(), seq, out.routed_experts->data.data(), out.routed_experts->rows);
    double worst = 0;
    for (size_t g = 0; g < out.token_ids.size(); ++g) {
      const std::vector<float> lp = log_softmax(
          ref.logits.data() + (prompt.size() + g - 1) * size_t(mc.vocab_size), mc.vocab_size);
      worst = std::max(worst, double(std::abs(lp[size_t(out.token_ids[g])] - out.logprobs[g])));
    }
    EXPECT_LT(worst, 0.05);
    std::printf(
        "[ window %d, block %d, chunk %d ] sliding-layer blocks held at most %d (bound %d) of the "
        "%d a full "
        "layer holds; max |dlogprob| vs reference %.4f\n",
        W, bs, chunk, peak, bound, full_peak, worst);
  }
}

// The KV memory of a 4k-token request (block 16, prefill chunks of 512, as the defaults): the
// sliding layers hold the window plus a chunk, the full layers all 4k tokens. Printed against
// what full attention on every layer would hold.
TEST(SlidingWindow, KvMemoryOfA4kTokenRequest) {
  const std::string model = test_model("gpt_oss");
  EngineConfig cfg = small_config(model, 300);
  cfg.max_num_batched_tokens = 512;
  Engine e(cfg);
  const ModelConfig& mc = e.model_config();
  std::vector<int> prompt(4000);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + int(i * 31 % 500);
  e.add_request(prompt, greedy(90, false));
  int peak = 0, full_peak = 0;
  while (e.has_unfinished()) {
    e.step();
    const EngineStats s = e.stats();
    peak = std::max(peak, s.num_window_blocks - s.free_window_blocks);
    full_peak = std::max(full_peak, s.num_blocks - s.free_blocks);
  }
  int sliding = 0;
  for (const LayerConfig& l : mc.layers) sliding += l.attention.sliding_window > 0;
  const int W = mc.layers[0].attention.sliding_window, bs = cfg.block_size;
  EXPECT_LE(peak, (W - 1 + bs - 1) / bs + 512 / bs + 2);
  const double per_block =
      double(bs) * double(mc.kv_cache_width()) * 2 / (1 << 20);  // MiB per layer, bf16
  const double held =
      per_block * (double(full_peak) * (mc.num_layers - sliding) + double(peak) * sliding);
  const double full_attention = per_block * double(full_peak) * mc.num_layers;
  std::printf(
      "[ 4k-token request, window %d ] KV held %.2f MiB (full layers %d blocks, sliding layers %d "
      "blocks) "
      "against %.2f MiB with every layer full: %.2fx\n",
      W, held, full_peak, peak, full_attention, full_attention / held);
  EXPECT_LT(held, 0.6 * full_attention);
}

// A second request with the first one's long prefix: the full layers' blocks are hit, and the
// sliding layers' blocks of the window before the hit's end are still cached (freed blocks keep
// their hash), so the hit is not shortened and its output equals its solo run.
TEST(SlidingWindow, PrefixHitsReuseTheWindowsCachedBlocks) {
  const std::string model = test_model("gpt_oss");
  std::vector<int> prefix(96);
  for (size_t i = 0; i < prefix.size(); ++i) prefix[i] = 5 + int(i * 53 % 400);
  std::vector<int> second = prefix;
  second.insert(second.end(), {7, 8, 9, 10, 11});
  Engine e(long_config(model, 32));
  e.generate({prefix}, {greedy(4)});
  const uint64_t hits_before = e.stats().prefix_hit_tokens;
  const RequestOutput got = e.generate({second}, {greedy(8)})[0];
  EXPECT_EQ(e.stats().prefix_hit_tokens - hits_before, 96u);
  Engine solo(long_config(model, 32));
  const RequestOutput want = solo.generate({second}, {greedy(8)})[0];
  EXPECT_EQ(got.token_ids, want.token_ids);
  EXPECT_EQ(got.logprobs, want.logprobs);
  EXPECT_EQ(got.routed_experts->data, want.routed_experts->data);
}

}  // namespace
}  // namespace r3::testing
