// The engine's router for one token (RouterSpec, model/config.h): expert scores, the experts
// chosen and their gate weights.
//
// - softmax (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE): softmax over all E logits; the k best scores,
//   descending, ties to the lower id; gate weights are those scores, divided by their sum when
//   `renormalize`.
// - sigmoid (GLM-4.5, DeepSeek-V3): s = sigmoid(logit) per expert; the choice uses s + bias
//   (e_score_correction_bias): with n_group > 1 the experts are split into n_group equal groups,
//   a group's score is the sum of its two best biased scores, and only the topk_group best groups
//   (descending, ties to the lower group) are eligible; the k best biased scores among eligible
//   experts are chosen, descending, ties to the lower id. Gate weights are the unbiased s of the
//   chosen, divided by (their sum + 1e-20) when `renormalize`, then times routed_scaling_factor.
// - top-k then softmax (GPT-OSS): logit + bias per expert; the k largest, descending, ties to the
//   lower id; gate weights are the softmax over those k biased logits.
//
// Ids come out in that choice order (the order routes are captured in). Ineligible experts are
// excluded outright, where Hugging Face's DeepseekV3TopkRouter fills their scores with 0: the
// two differ only when fewer than k eligible experts have a positive biased score.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace r3 {

// logits: [E], replaced by the scores (softmax, sigmoid, or biased logits). bias: [E] or null.
// scratch: reused.
void route_token(const RouterSpec& spec, float* logits, const float* bias, int E, int K,
                 int16_t* ids, float* weights, std::vector<float>& scratch);

}  // namespace r3
