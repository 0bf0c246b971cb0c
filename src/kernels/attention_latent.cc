#include "kernels/attention_latent.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "kernels/exp.h"

namespace r3::kernels {

namespace {
inline float widen(float v) { return v; }
inline float widen(uint16_t bits) { return bf16_to_f32(bits); }
}  // namespace

template <typename KvT>
void attend_latent(const float* q, int value_width, int pos, float scale, const PagedLatent<KvT>& cache,
                   float* scores, float* out) {
  const int n = pos + 1, w = cache.width, bs = cache.block_size;
  auto row = [&](int j) {
    return cache.base + (int64_t(cache.block_table[j / bs]) * bs + j % bs) * int64_t(w);
  };
  float m = -INFINITY;
  for (int j = 0; j < n; ++j) {
    const KvT* r = row(j);
    float acc = 0.f;
    for (int d = 0; d < w; ++d) acc = std::fma(q[d], widen(r[d]), acc);
    scores[j] = acc * scale;
    m = std::max(m, scores[j]);
  }
  exp_below_max(scores, n, m, 1.f, scores);
  float sum = 0.f;
  for (int j = 0; j < n; ++j) sum += scores[j];
  std::fill(out, out + value_width, 0.f);
  for (int j = 0; j < n; ++j) {
    const KvT* r = row(j);
    for (int d = 0; d < value_width; ++d) out[d] = std::fma(scores[j], widen(r[d]), out[d]);
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < value_width; ++d) out[d] *= inv;
}

template void attend_latent(const float*, int, int, float, const PagedLatent<float>&, float*, float*);
template void attend_latent(const float*, int, int, float, const PagedLatent<uint16_t>&, float*, float*);

}  // namespace r3::kernels
