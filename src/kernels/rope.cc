// RoPE (ops.h): a table of cos/sin and a scalar rotation, the same on every instruction set.
#include <cmath>

#include "kernels/ops.h"

namespace r3::kernels {

namespace {
std::vector<double> plain_inv_freq(int head_dim, float theta) {
  std::vector<double> f(size_t(head_dim / 2));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = std::pow(double(theta), -2.0 * double(i) / double(head_dim));
  return f;
}
}  // namespace

Rope::Rope(int head_dim, float theta, int max_pos)
    : Rope(plain_inv_freq(head_dim, theta), 1.f, max_pos) {}

Rope::Rope(const std::vector<double>& inv_freq, float attention_factor, int max_pos)
    : half_(int(inv_freq.size())), max_pos_(max_pos) {
  storage_.resize(size_t(max_pos) * size_t(half_) * 2);
  table_ = storage_.data();
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < half_; ++i) {
      double a = double(p) * float(inv_freq[size_t(i)]);
      table_[(size_t(p) * half_ + i) * 2] = float(std::cos(a)) * attention_factor;
      table_[(size_t(p) * half_ + i) * 2 + 1] = float(std::sin(a)) * attention_factor;
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

void Rope::apply_interleaved(float* h, int pos) const {
  const float* cs = table_ + size_t(pos) * half_ * 2;
  for (int i = 0; i < half_; ++i) {
    float c = cs[2 * i], s = cs[2 * i + 1];
    float a = h[2 * i], b = h[2 * i + 1];
    h[2 * i] = a * c - b * s;
    h[2 * i + 1] = b * c + a * s;
  }
}

}  // namespace r3::kernels
