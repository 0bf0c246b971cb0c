#include "kernels/ops.h"

#include <algorithm>
#include <cmath>

namespace r3::kernels {

void rms_norm(const float* x, const TensorView& w, int64_t w_offset, int n, float eps, float* y) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / float(n) + eps);
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * w.at(w_offset + i);
}

Rope::Rope(int head_dim, float theta, int max_pos) : half_(head_dim / 2), max_pos_(max_pos) {
  storage_.resize(size_t(max_pos) * size_t(half_) * 2);
  table_ = storage_.data();
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < half_; ++i) {
      double inv_freq = std::pow(double(theta), -2.0 * i / double(head_dim));
      double a = double(p) * float(inv_freq);
      table_[(size_t(p) * half_ + i) * 2] = float(std::cos(a));
      table_[(size_t(p) * half_ + i) * 2 + 1] = float(std::sin(a));
    }
}

void Rope::apply(float* h, int pos) const {
  const float* cs = table_ + size_t(pos) * half_ * 2;
  for (int i = 0; i < half_; ++i) {
    float c = cs[2 * i], s = cs[2 * i + 1];
    float a = h[i], b = h[i + half_];
    h[i] = a * c - b * s;
    h[i + half_] = b * c + a * s;
  }
}

void silu_mul(const float* gate, const float* up, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

void softmax(const float* x, int n, float* out) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += (out[i] = std::exp(x[i] - m));
  for (int i = 0; i < n; ++i) out[i] /= s;
}

}  // namespace r3::kernels
