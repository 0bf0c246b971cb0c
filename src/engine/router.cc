#include "engine/router.h"

#include <algorithm>
#include <cmath>

#include "kernels/exp.h"
#include "kernels/ops.h"
#include "kernels/router.h"

namespace r3 {

void route_token(const RouterSpec& spec, float* logits, const float* bias, int E, int K,
                 int16_t* ids, float* weights, std::vector<float>& scratch) {
  if (spec.scoring == RouterScoring::Softmax) {
    kernels::softmax(logits, E, logits);
    kernels::router_topk(logits, E, K, spec.renormalize, ids, weights);
  } else if (spec.scoring == RouterScoring::TopkSoftmax) {
    if (bias)
      for (int e = 0; e < E; ++e) logits[e] += bias[e];
    kernels::router_topk(logits, E, K, false, ids, weights);  // weights: the chosen logits
    kernels::softmax(weights, K, weights);
  } else {
    float* s = logits;
    for (int e = 0; e < E; ++e) s[e] = kernels::sigmoid(s[e]);
    // The choice: biased scores, ineligible experts (outside the kept groups) at -inf, so the
    // shared top-k picks only eligible ones (the config guarantees k of them).
    scratch.resize(size_t(E));
    float* choice = scratch.data();
    for (int e = 0; e < E; ++e) choice[e] = bias ? s[e] + bias[e] : s[e];
    if (spec.n_group > 1) {
      const int per = E / spec.n_group;
      thread_local std::vector<float> group, best;
      thread_local std::vector<int16_t> ids_of;
      group.resize(size_t(spec.n_group));
      best.resize(size_t(std::max(2, spec.topk_group)));
      ids_of.resize(best.size());
      for (int g = 0; g < spec.n_group; ++g) {  // a group's score: its two best choice scores
        kernels::router_topk(choice + size_t(g) * per, per, 2, false, ids_of.data(), best.data());
        group[size_t(g)] = best[0] + best[1];
      }
      kernels::router_topk(group.data(), spec.n_group, spec.topk_group, false, ids_of.data(),
                           best.data());
      thread_local std::vector<char> keep;
      keep.assign(size_t(spec.n_group), 0);
      for (int k = 0; k < spec.topk_group; ++k) keep[size_t(ids_of[size_t(k)])] = 1;
      for (int e = 0; e < E; ++e)
        if (!keep[size_t(e / per)]) choice[e] = -INFINITY;
    }
    kernels::router_topk(choice, E, K, false, ids, weights);
    float sum = 0.f;
    for (int j = 0; j < K; ++j) {
      weights[j] = s[ids[j]];  // the unbiased score: the bias chooses, never weighs
      sum += weights[j];
    }
    if (spec.renormalize)
      for (int j = 0; j < K; ++j) weights[j] /= sum + 1e-20f;
    for (int j = 0; j < K; ++j) weights[j] *= spec.routed_scaling_factor;
  }
}

}  // namespace r3
