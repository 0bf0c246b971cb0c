// Text out of the engine: the detokenised text of every output equals decoding its tokens; stop
// strings (randomised, spanning token boundaries) cut the text at the first match and finish the
// request there with its tokens, logprobs and routes up to the token that completed the match;
// a stream's texts only ever grow (the bytes a stop string could begin with are held back) and
// end at the non-streamed text.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "core/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/make_model.h"
#include "test_models.h"
#include "test_tokenizer.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;

using testing::model_with_tokenizer;

SamplingParams sampled(int max_tokens, uint64_t seed) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.temperature = 1.f;
  p.seed = seed;
  p.ignore_eos = true;
  p.return_routed_experts = true;
  return p;
}

TEST(TextOutput, MakeModelSizesTheVocabularyToTheTokenizerAndCopiesIt) {
  const std::string dir = model_with_tokenizer();
  EXPECT_TRUE(fs::exists(fs::path(dir) / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "tokenizer_config.json"));
  Engine e(testing::small_config(dir));
  ASSERT_NE(e.tokenizer(), nullptr);
  EXPECT_EQ(e.model_config().vocab_size, 320);  // 256 bytes + 16 merges + 3 specials, rounded to 64
  EXPECT_EQ(e.model_config().eos_token_id, *e.tokenizer()->token_to_id("<|im_end|>"));
}

TEST(TextOutput, TextIsTheDecodedTokensAndStopStringsCutItWhereTheyFirstMatch) {
  const std::string dir = model_with_tokenizer();
  std::mt19937_64 rng(11);
  Engine plain(testing::small_config(dir));
  // Plain, overlapped, and speculative (a step may add several tokens; each is checked for a
  // stop string as if sampled alone).
  for (int mode : {0, 1, 2}) {
    EngineConfig c = testing::small_config(dir);
    c.overlap_scheduler = mode == 1;
    if (mode == 2) c.speculative_algorithm = "NGRAM", c.speculative_num_draft_tokens = 4;
    Engine e(c);
    const auto tok = e.tokenizer();
    int stopped = 0;
    for (int trial = 0; trial < 24; ++trial) {
      SCOPED_TRACE("mode " + std::to_string(mode) + " trial " + std::to_string(trial));
      const std::vector<int> prompt = tok->encode("the cat and the " + std::to_string(trial));
      const uint64_t seed = rng();
      const RequestOutput full = e.generate({prompt}, {sampled(24, seed)})[0];
      if (mode == 2) {
        const RequestOutput want = plain.generate({prompt}, {sampled(24, seed)})[0];
        EXPECT_EQ(full.token_ids, want.token_ids);
        EXPECT_EQ(full.logprobs, want.logprobs);
        EXPECT_EQ(full.text, want.text);
      }
      EXPECT_EQ(full.text, tok->decode(full.token_ids, true, false));
      // A stop string taken from the text, starting anywhere (often inside a token's bytes).
      const std::vector<std::string_view> chars = text::utf8_chars(full.text);
      if (chars.size() < 4) continue;
      const size_t first = std::uniform_int_distribution<size_t>(1, chars.size() - 2)(rng);
      const size_t len =
          std::uniform_int_distribution<size_t>(1, std::min<size_t>(5, chars.size() - first))(rng);
      std::string stop;
      for (size_t k = first; k < first + len; ++k) stop += chars[k];
      const size_t at = full.text.find(stop);
      for (bool include : {false, true}) {
        SamplingParams p = sampled(24, seed);
        p.stop = {"never matches \x01", stop};
        p.include_stop_str_in_output = include;
        // Streamed: every output's text extends the one before, and none shows the stop string.
        const uint64_t id = e.add_request(prompt, p);
        std::string last;
        RequestOutput done;
        while (e.has_unfinished())
          for (RequestOutput& o : e.step()) {
            if (o.request_id != id) continue;
            EXPECT_EQ(o.text.compare(0, last.size(), last), 0)
                << "the text shrank: " << last << " -> " << o.text;
            last = o.text;
            if (!o.finished) {
              EXPECT_EQ(o.text.find(stop), std::string::npos);
            }
            if (o.finished) done = std::move(o);
          }
        ASSERT_TRUE(done.finished);
        EXPECT_EQ(done.finish_reason, "stop");
        EXPECT_EQ(done.stop_str, stop);
        EXPECT_EQ(done.text, full.text.substr(0, include ? at + stop.size() : at));
        // Tokens: a prefix of the unstopped run, ending with the token that completed the match.
        ASSERT_LE(done.token_ids.size(), full.token_ids.size());
        EXPECT_TRUE(
            std::equal(done.token_ids.begin(), done.token_ids.end(), full.token_ids.begin()));
        const std::string upto = tok->decode(done.token_ids, true, false);
        // What a stream had seen one token earlier: the bytes up to the last complete character.
        const std::string raw = tok->decode_raw(
            std::span<const int32_t>(done.token_ids.data(), done.token_ids.size() - 1), true);
        const std::string before =
            text::utf8_lossy(std::string_view(raw).substr(0, text::utf8_stable_prefix(raw)));
        EXPECT_NE(upto.find(stop), std::string::npos);
        EXPECT_EQ(before.find(stop), std::string::npos);
        EXPECT_EQ(done.logprobs.size(), done.token_ids.size());
        ASSERT_TRUE(done.routed_experts.has_value());
        EXPECT_EQ(done.routed_experts->rows, int(prompt.size() + done.token_ids.size()) - 1);
        // The routes are the unstopped run's rows for those tokens.
        const RouteArray& fr = *full.routed_experts;
        const size_t row = size_t(fr.layers) * size_t(fr.k);
        EXPECT_TRUE(std::equal(done.routed_experts->data.begin(), done.routed_experts->data.end(),
                               fr.data.begin()));
        EXPECT_EQ(done.routed_experts->data.size(), size_t(done.routed_experts->rows) * row);
        ++stopped;
      }
    }
    EXPECT_GT(stopped, 20);
    if (mode == 2) {
      EXPECT_GT(e.stats().spec_accepted_tokens, 0u);
    }
  }
}

TEST(TextOutput, StopStringsWithoutATokenizerAreRefused) {
  Engine e(testing::small_config(testing::test_model("olmoe")));
  EXPECT_EQ(e.tokenizer(), nullptr);
  SamplingParams p = testing::greedy(4);
  p.stop = {"x"};
  try {
    e.add_request({1, 2, 3}, p);
    FAIL() << "accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("need a tokenizer"), std::string::npos) << err.what();
  }
  p.stop = {""};
  EXPECT_THROW(e.add_request({1, 2, 3}, p), Error);
}

}  // namespace
}  // namespace r3
