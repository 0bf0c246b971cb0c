#include "engine/sampling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace r3 {
namespace {

std::vector<float> logits_of(std::vector<double> probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(float(std::log(p)));
  return l;
}

// Every refusal of SamplingParams::validate names the field it concerns (FieldError), so a
// front end reports it under its own name without reading the message.
TEST(Sampling, EveryRefusalNamesItsField) {
  const std::vector<std::pair<std::string, std::function<void(SamplingParams&)>>> cases = {
      {"max_tokens", [](SamplingParams& p) { p.max_tokens = -1; }},
      {"temperature", [](SamplingParams& p) { p.temperature = -0.5f; }},
      {"temperature", [](SamplingParams& p) { p.temperature = NAN; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 0.f; }},
      {"top_k", [](SamplingParams& p) { p.top_k = -2; }},
      {"stop_token_ids",
       [](SamplingParams& p) {
         p.stop_token_ids = {1, 100};
       }},
      {"stop", [](SamplingParams& p) { p.stop = {""}; }},
      {"stop", [](SamplingParams& p) { p.stop.assign(kMaxStopStrings + 1, "x"); }},
      {"routed_experts_start", [](SamplingParams& p) { p.routed_experts_start = -1; }},
      {"return_routed_expert_weights",
       [](SamplingParams& p) { p.return_routed_expert_weights = true; }},
      {"top_logprobs", [](SamplingParams& p) { p.top_logprobs = kMaxTopLogprobs + 1; }},
      {"prompt_logprobs_start", [](SamplingParams& p) { p.prompt_logprobs_start = -2; }},
  };
  for (const auto& [field, spoil] : cases) {
    SamplingParams p;
    p.validate(100);  // the defaults pass
    spoil(p);
    try {
      p.validate(100);
      ADD_FAILURE() << field << ": accepted";
    } catch (const FieldError& e) {
      EXPECT_EQ(e.field(), field) << e.what();
    }
  }
}

TEST(Sampling, GreedyIsArgmaxWithTiesToLowerId) {
  std::vector<float> l = {0.f, 2.f, 2.f, 1.f};
  std::vector<float> s;
  std::vector<int> o;
  SamplingParams p;
  p.temperature = 0.f;
  Sample x = sample_token(l.data(), 4, p, 0, s, o);
  EXPECT_EQ(x.token, 1);
  double z = 0;
  for (float v : l) z += std::exp(v);
  EXPECT_NEAR(x.logprob, 2.0 - std::log(z), 1e-6);
}

TEST(Sampling, KeyedBySeedAndPositionOnly) {
  std::vector<float> l = logits_of({0.1, 0.2, 0.3, 0.4});
  std::vector<float> s;
  std::vector<int> o;
  SamplingParams p;
  p.seed = 42;
  for (int pos = 0; pos < 50; ++pos)
    EXPECT_EQ(sample_token(l.data(), 4, p, pos, s, o).token,
              sample_token(l.data(), 4, p, pos, s, o).token);
  int differ = 0;
  SamplingParams q = p;
  q.seed = 43;
  for (int pos = 0; pos < 50; ++pos)
    differ += sample_token(l.data(), 4, p, pos, s, o).token !=
              sample_token(l.data(), 4, q, pos, s, o).token;
  EXPECT_GT(differ, 10);
}

TEST(Sampling, FrequenciesFollowTheDistribution) {
  std::vector<double> probs = {0.1, 0.2, 0.3, 0.4};
  std::vector<float> l = logits_of(probs);
  std::vector<float> s;
  std::vector<int> o;
  SamplingParams p;
  p.seed = 7;
  std::map<int, int> count;
  const int N = 20000;
  for (int pos = 0; pos < N; ++pos) ++count[sample_token(l.data(), 4, p, pos, s, o).token];
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(double(count[t]) / N, probs[size_t(t)], 0.015);
}

TEST(Sampling, TopKAndTopPRestrictTheCandidates) {
  std::vector<float> l = logits_of({0.05, 0.15, 0.3, 0.5});
  std::vector<float> s;
  std::vector<int> o;
  SamplingParams k;
  k.top_k = 2;
  SamplingParams tp;
  tp.top_p = 0.6f;  // the nucleus {3, 2} holds 0.8 >= 0.6; {3} alone holds 0.5
  std::map<int, int> ck, cp;
  for (int pos = 0; pos < 4000; ++pos) {
    ++ck[sample_token(l.data(), 4, k, pos, s, o).token];
    ++cp[sample_token(l.data(), 4, tp, pos, s, o).token];
  }
  EXPECT_EQ(ck.count(0) + ck.count(1), 0u);
  EXPECT_EQ(cp.count(0) + cp.count(1), 0u);
  EXPECT_NEAR(double(ck[3]) / 4000, 0.5 / 0.8, 0.03);
  EXPECT_NEAR(double(cp[3]) / 4000, 0.5 / 0.8, 0.03);
}

// A vocabulary large enough for the vectorised exp and sums: logprobs match a double log-softmax,
// and draws at temperature 2 follow p^(1/2) renormalised.
TEST(Sampling, LargeVocabularyLogprobsAndTemperature) {
  const int V = 1000;
  std::vector<float> l(size_t(V), -40.f);
  const std::vector<double> probs = {0.1, 0.2, 0.3, 0.4};
  for (int i = 0; i < 4; ++i) l[size_t(100 + 200 * i)] = float(std::log(probs[size_t(i)]));
  double z = 0;
  for (float v : l) z += std::exp(double(v));
  std::vector<float> s;
  std::vector<int> o;
  SamplingParams p;
  p.temperature = 2.f;
  double zt = 0;
  for (double q : probs) zt += std::sqrt(q);
  std::map<int, int> count;
  const int N = 20000;
  for (int pos = 0; pos < N; ++pos) {
    const Sample x = sample_token(l.data(), V, p, pos, s, o);
    ++count[x.token];
    ASSERT_NEAR(x.logprob, double(l[size_t(x.token)]) - std::log(z), 1e-5);
  }
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(double(count[100 + 200 * i]) / N, std::sqrt(probs[size_t(i)]) / zt, 0.015);
}

TEST(Sampling, ValidateNamesTheParameter) {
  SamplingParams p;
  p.max_tokens = -1;
  EXPECT_THROW(p.validate(10), Error);
  p = {};
  p.top_logprobs = kMaxTopLogprobs + 1;
  EXPECT_THROW(p.validate(10), Error);
  p = {};
  p.prompt_logprobs_start = -2;
  EXPECT_THROW(p.validate(10), Error);
  p = {};
  p.temperature = -1;
  EXPECT_THROW(p.validate(10), Error);
  p = {};
  p.stop_token_ids = {10};
  try {
    p.validate(10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stop_token_ids"), std::string::npos);
  }
}

}  // namespace
}  // namespace r3
