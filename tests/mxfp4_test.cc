// MXFP4 experts (GPT-OSS as released) against the same weights decoded into the bf16 layout:
// the reference forward decodes them independently (TensorView::at) and must give identical
// logits; the engine must give identical tokens, logprobs and routes. (EngineFuzz runs the
// everything-on schedule on gpt_oss_mxfp4 too: every request bit-identical to its solo run.)
#include <gtest/gtest.h>

#include <random>

#include "engine_test_util.h"
#include "model/checkpoint.h"
#include "reference/reference_forward.h"
#include "test_models.h"

namespace r3::testing {
namespace {

std::vector<int> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> t(static_cast<size_t>(n));
  for (int& x : t) x = std::uniform_int_distribution<int>(3, vocab - 1)(rng);
  return t;
}

TEST(Mxfp4, ReferenceLogitsIdenticalToTheDequantizedCheckpoint) {
  for (const char* preset : {"tiny", "small"}) {
    auto q = Checkpoint::open(test_model("gpt_oss_mxfp4", preset));
    auto d = Checkpoint::open(test_model("gpt_oss_mxfp4_dequantized", preset));
    ASSERT_TRUE(q->config().experts_mxfp4);
    ASSERT_FALSE(d->config().experts_mxfp4);
    ASSERT_EQ(q->weights().layers[0].experts[0].gate.dtype, DType::MXFP4);
    ASSERT_EQ(d->weights().layers[0].experts[0].gate.dtype, DType::BF16);
    // Longer than the sliding window, so windowed and full layers differ.
    const std::vector<int> tok = random_tokens(40, q->config().vocab_size, 7);
    const ReferenceResult a = reference_forward(q->weights(), tok),
                          b = reference_forward(d->weights(), tok);
    EXPECT_EQ(a.logits, b.logits) << preset;
    EXPECT_EQ(a.routes, b.routes) << preset;
  }
}

TEST(Mxfp4, EngineIdenticalToTheDequantizedCheckpoint) {
  expect_identical_runs(test_model("gpt_oss_mxfp4"), test_model("gpt_oss_mxfp4_dequantized"), 31,
                        24);
}

}  // namespace
}  // namespace r3::testing
