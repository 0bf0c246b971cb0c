#include "engine/router.h"

#include <cmath>

#include "kernels/exp.h"
#include "kernels/ops.h"
#include "kernels/router.h"

namespace r3 {

namespace {

// sigmoid(x) from e = exp(-|x|) <= 1 (the form SiLU uses, kernels/ops.cc): never overflows.
float sigmoid(float x) {
  const float e = kernels::exp_nonpositive(0.f - std::fabs(x));
  return (x >= 0.f ? 1.f : e) / (1.f + e);
}

// The best `k` of `score` among experts with eligible[e], descending, ties to the lower id.
void top_k(const float* score, const std::vector<char>& eligible, int E, int K, int16_t* ids) {
  for (int j = 0; j < K; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      if (!eligible[size_t(e)]) continue;
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= ids[i] == e;
      if (!taken && (best < 0 || score[e] > score[best])) best = e;
    }
    ids[j] = int16_t(best);
  }
}

}  // namespace

void route_token(const RouterSpec& spec, float* logits, const float* bias, int E, int K, int16_t* ids,
                 float* weights, std::vector<float>& scratch) {
  if (spec.scoring == RouterScoring::Softmax) {
    kernels::softmax(logits, E, logits);
    kernels::router_topk(logits, E, K, spec.renormalize, ids, weights);
  } else {
    float* s = logits;
    for (int e = 0; e < E; ++e) s[e] = sigmoid(s[e]);
    scratch.resize(size_t(E));
    float* choice = scratch.data();
    for (int e = 0; e < E; ++e) choice[e] = bias ? s[e] + bias[e] : s[e];
    thread_local std::vector<char> eligible;
    eligible.assign(size_t(E), 1);
    if (spec.n_group > 1) {
      const int per = E / spec.n_group;
      std::vector<float> group(size_t(spec.n_group));
      for (int g = 0; g < spec.n_group; ++g) {
        const float* c = choice + size_t(g) * per;
        int b1 = 0;
        for (int e = 1; e < per; ++e)
          if (c[e] > c[b1]) b1 = e;
        int b2 = b1 == 0 ? 1 : 0;
        for (int e = 0; e < per; ++e)
          if (e != b1 && c[e] > c[b2]) b2 = e;
        group[size_t(g)] = c[b1] + c[b2];
      }
      std::vector<char> all(size_t(spec.n_group), 1);
      std::vector<int16_t> kept(size_t(spec.topk_group));
      top_k(group.data(), all, spec.n_group, spec.topk_group, kept.data());
      eligible.assign(size_t(E), 0);
      for (int16_t g : kept)
        for (int e = 0; e < per; ++e) eligible[size_t(g) * per + e] = 1;
    }
    top_k(choice, eligible, E, K, ids);
    float sum = 0.f;
    for (int j = 0; j < K; ++j) {
      weights[j] = s[ids[j]];
      sum += weights[j];
    }
    if (spec.renormalize)
      for (int j = 0; j < K; ++j) weights[j] /= sum + 1e-20f;
    for (int j = 0; j < K; ++j) weights[j] *= spec.routed_scaling_factor;
  }
}

}  // namespace r3
