// The dense MLP block of the runner: SwiGLU over every token (dense layers, and MoE layers'
// shared experts).
#include "engine/model_runner.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"

namespace r3 {

using kernels::matmul;
using kernels::round_to_bf16;

void ModelRunner::dense_ffn(const ExpertWeights& w, int T, float* out) {
  const int I = int(w.gate.shape[0]);
  const kernels::MatmulOut gate_up[] = {{&w.gate, gate_.data()}, {&w.up, up_.data()}};
  kernels::matmul_many({h_.data(), hb_.data(), T}, gate_up, pool_);
  kernels::silu_mul(gate_.data(), up_.data(), act_.data(), T * I);
  round_to_bf16(act_.data(), int64_t(T) * I, actb_.data());
  matmul({act_.data(), actb_.data(), T}, w.down, out, pool_);
  weight_bytes_ += w.gate.nbytes() + w.up.nbytes() + w.down.nbytes();
}

}  // namespace r3
