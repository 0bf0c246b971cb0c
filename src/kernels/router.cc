#include "kernels/router.h"

#include <cstddef>
#include <vector>

namespace r3::kernels {

void router_topk(const float* probs, int E, int k, bool renormalize, int16_t* ids, float* weights) {
  // Selection by k passes: k is small (<= 8) and this keeps the tie rule explicit.
  uint64_t taken[8] = {0};  // up to 512 experts tracked in bits
  bool big = E > 512;
  std::vector<bool> taken_big(big ? size_t(E) : 0);
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool t = big ? bool(taken_big[size_t(e)]) : (taken[e >> 6] >> (e & 63)) & 1;
      if (t) continue;
      if (best < 0 || probs[e] > probs[best]) best = e;  // strict '>' keeps the lower id on ties
    }
    if (big)
      taken_big[size_t(best)] = true;
    else
      taken[best >> 6] |= 1ull << (best & 63);
    ids[j] = int16_t(best);
    weights[j] = probs[best];
  }
  if (renormalize) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) s += weights[j];
    for (int j = 0; j < k; ++j) weights[j] /= s;
  }
}

}  // namespace r3::kernels
