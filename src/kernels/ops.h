// Small per-token ops of the engine forward: RMSNorm, RoPE, biases, SiLU-gating, softmax. Each
// works on one token's vector, so batch composition cannot change its result.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor_view.h"

namespace r3::kernels {

// y = x / sqrt(mean(x^2) + eps) * (offset + w) over n values (fp32; the squares summed in
// dot_f32's order). offset 1: a zero-centred norm (Qwen3-Next, Qwen3.5); 0 adds nothing (0 + w ==
// w).
void rms_norm(const float* x, const TensorView& w, int64_t w_offset, int n, float eps, float* y,
              float offset = 0.f);

// Precomputed cos/sin of RoPE ("rotate half": pairs i and i + D/2).
class Rope {
 public:
  Rope(int head_dim, float theta, int max_pos);
  // Given inverse frequencies (one per pair; model/config.h rope_inv_freq), cos and sin scaled by
  // attention_factor (YaRN).
  Rope(const std::vector<double>& inv_freq, float attention_factor, int max_pos);
  void apply(float* head, int pos) const;  // one head vector in place
  // The same angles on adjacent pairs (2i, 2i + 1) (DeepSeek-V3's rope_interleave).
  void apply_interleaved(float* head, int pos) const;
  int max_pos() const { return max_pos_; }

 private:
  int half_, max_pos_;
  float* table_;  // [max_pos, half] cos then sin
  std::vector<float> storage_;
};

// x[i] += b[b_offset + i] for i < n: one fp32 add each, the bias (fp32, or bf16 widened exactly)
// as it is stored; any other stored type is read through TensorView::at.
void add_bias(float* x, const TensorView& b, int64_t b_offset, int n);

// out[i] = silu(gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, float* out, int n);

// GPT-OSS's expert activation: out[i] = (clamp(up[i], -limit, limit) + 1) * g * sigmoid(alpha * g),
// g = min(gate[i], limit).
void clamped_swiglu(const float* gate, const float* up, float* out, int n, float limit,
                    float alpha);

// Softmax over n values (fp32: max, exp_nonpositive of x - max, sequential sum).
void softmax(const float* x, int n, float* out);

// Sum in double, value i into lane i % 8, then a fixed pairwise tree of the 8 lanes.
double sum_f64(const float* x, int n);

}  // namespace r3::kernels
