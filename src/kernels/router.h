// Router top-k: softmax over all experts (fp32), the k best in descending score with ties to the
// lower id, and the gate weights per the architecture (renormalised over the k or not).
#pragma once
#include <cstdint>

namespace r3::kernels {

// probs: [E] softmax scores. ids/weights: [k].
void router_topk(const float* probs, int E, int k, bool renormalize, int16_t* ids, float* weights);

}  // namespace r3::kernels
