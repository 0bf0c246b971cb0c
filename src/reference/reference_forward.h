// The math oracle and the trainer-side forward: plain fp32 loops over one sequence, no KV cache,
// sharing no code with src/kernels. Weights are read through TensorView::at (widened to fp32),
// activations stay fp32 throughout.
#pragma once
#include <cstdint>
#include <vector>

#include "model/checkpoint.h"

namespace r3 {

struct ReferenceResult {
  int seq_len = 0, vocab = 0, num_moe_layers = 0, top_k = 0, num_experts = 0;
  std::vector<float> logits;    // [S, V]
  std::vector<int16_t> routes;  // [S, L_moe, K], router order (descending score, ties to lower id)
  std::vector<float> gate_weights;  // [S, L_moe, K]: the weight each expert of `routes` got
  std::vector<float> router_probs;  // [S, L_moe, E], softmax over all experts (fp32; of the
                                    // biased logits where the router has a logit bias), or
                                    // each expert's sigmoid for sigmoid routers (unbiased)
};

// Replay: `replay` (optional) is [rows, L_moe, K] with rows <= S. A row of valid ids forces that
// expert set; gate weights are recomputed from this forward's own scores gathered at the forced
// ids (the full softmax, or for sigmoid routers the unbiased sigmoid scores: the selection bias
// never enters a weight; for GPT-OSS's top-k-then-softmax router a softmax over the forced ids'
// biased logits), with the architecture's normalisation (renormalised over the k for
// Mixtral and for norm_topk_prob; raw scores otherwise) and routed_scaling_factor. An all -1 row,
// and every row past `rows`, uses the model's own router. A partly -1 row, duplicate ids or ids
// outside [0, E) throw r3::Error naming the position and MoE layer. `routes` in the result always
// reports the experts actually used.
ReferenceResult reference_forward(const ModelWeights& w, const std::vector<int>& tokens,
                                  const int16_t* replay = nullptr, int replay_rows = 0);

// log-softmax of one logits row, in double for accuracy (fp32 result).
std::vector<float> log_softmax(const float* logits, int n);

}  // namespace r3
