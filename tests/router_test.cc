// The engine's router (engine/router.h) on hand-computed cases: sigmoid scores with a
// selection-only bias, group-limited choice, renormalisation and routed scaling; the softmax
// router unchanged.
#include "engine/router.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace r3 {
namespace {

// Logits whose sigmoid is exactly `p` up to float rounding.
std::vector<float> logits_for(const std::vector<float>& p) {
  std::vector<float> out;
  for (float x : p) out.push_back(std::log(x / (1.f - x)));
  return out;
}

struct Routed {
  std::vector<int16_t> ids;
  std::vector<float> weights;
};

Routed route(const RouterSpec& spec, std::vector<float> logits, const std::vector<float>& bias,
             int K) {
  Routed r{std::vector<int16_t>(size_t(K)), std::vector<float>(size_t(K))};
  std::vector<float> scratch;
  route_token(spec, logits.data(), bias.empty() ? nullptr : bias.data(), int(logits.size()), K,
              r.ids.data(), r.weights.data(), scratch);
  return r;
}

RouterSpec sigmoid_spec(int n_group, int topk_group, bool renormalize, float scale) {
  RouterSpec s;
  s.scoring = RouterScoring::Sigmoid;
  s.selection_bias = true;
  s.n_group = n_group;
  s.topk_group = topk_group;
  s.renormalize = renormalize;
  s.routed_scaling_factor = scale;
  return s;
}

TEST(Router, SelectionBiasChangesTheChoiceButNotTheWeights) {
  // Scores 0.9, 0.8, 0.7, 0.1; a bias of +0.25 on expert 2 lifts it above expert 1 for the
  // choice, while its gate weight stays its unbiased 0.7.
  const std::vector<float> logits = logits_for({0.9f, 0.8f, 0.7f, 0.1f});
  Routed r = route(sigmoid_spec(1, 1, false, 1.f), logits, {0.f, 0.f, 0.25f, 0.f}, 2);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{2, 0}));  // 0.95 then 0.9: choice order
  EXPECT_NEAR(r.weights[0], 0.7f, 1e-6f);
  EXPECT_NEAR(r.weights[1], 0.9f, 1e-6f);
  r = route(sigmoid_spec(1, 1, false, 1.f), logits, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{0, 1}));
}

TEST(Router, ABiasChangesWhichGroupWins) {
  // Two groups of two. Unbiased, group 0 sums 0.6 + 0.5 = 1.1 and group 1 sums 0.9 + 0.1 = 1.0,
  // so group 0 is kept; a +0.2 bias on expert 3 makes group 1 sum 1.2 and win.
  const std::vector<float> logits = logits_for({0.6f, 0.5f, 0.9f, 0.1f});
  Routed r = route(sigmoid_spec(2, 1, false, 1.f), logits, {0.f, 0.f, 0.f, 0.f}, 1);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{0}));  // expert 2 (0.9) is best overall but its group lost
  r = route(sigmoid_spec(2, 1, false, 1.f), logits, {0.f, 0.f, 0.f, 0.2f}, 1);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{2}));
  EXPECT_NEAR(r.weights[0], 0.9f, 1e-6f);
}

TEST(Router, AGroupWithTwoGoodExpertsBeatsOneWithTheBest) {
  // Group 0: 0.95 and 0.05 (sum 1.0); group 1: 0.7 and 0.6 (sum 1.3); group 2: 0.2, 0.2.
  // With one group kept, the best single expert (0) is not eligible.
  const std::vector<float> logits = logits_for({0.95f, 0.05f, 0.7f, 0.6f, 0.2f, 0.2f});
  Routed r = route(sigmoid_spec(3, 1, false, 1.f), logits, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{2, 3}));
  // Two groups kept: groups 1 and 0; the k = 2 best of their experts are 0 then 2.
  r = route(sigmoid_spec(3, 2, false, 1.f), logits, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{0, 2}));
}

TEST(Router, RenormalisationThenRoutedScaling) {
  const std::vector<float> logits = logits_for({0.8f, 0.2f, 0.6f, 0.4f});
  Routed r = route(sigmoid_spec(1, 1, true, 2.5f), logits, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{0, 2}));
  EXPECT_NEAR(r.weights[0], 0.8f / 1.4f * 2.5f, 1e-6f);
  EXPECT_NEAR(r.weights[1], 0.6f / 1.4f * 2.5f, 1e-6f);
  r = route(sigmoid_spec(1, 1, false, 2.5f), logits, {}, 2);  // scaled, not renormalised
  EXPECT_NEAR(r.weights[0], 0.8f * 2.5f, 1e-6f);
}

TEST(Router, TiesGoToTheLowerIdAndTheLowerGroup) {
  const std::vector<float> logits = logits_for({0.5f, 0.5f, 0.5f, 0.5f});
  Routed r = route(sigmoid_spec(2, 1, false, 1.f), logits, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{0, 1}));
}

TEST(Router, SoftmaxRouterKeepsItsSemantics) {
  RouterSpec s;  // softmax, no renormalisation
  Routed r = route(s, {2.f, 1.f, 0.f, 3.f}, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int16_t>{3, 0}));
  const float z = std::exp(2.f) + std::exp(1.f) + std::exp(0.f) + std::exp(3.f);
  EXPECT_NEAR(r.weights[0], std::exp(3.f) / z, 1e-6f);
  s.renormalize = true;
  r = route(s, {2.f, 1.f, 0.f, 3.f}, {}, 2);
  EXPECT_NEAR(r.weights[0] + r.weights[1], 1.f, 1e-6f);
}

}  // namespace
}  // namespace r3
