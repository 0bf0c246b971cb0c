// Latent attention (kernels/attention_latent.h): every kernel set, however the heads are grouped
// into calls, gives the bits of the contract written out here one head and one key at a time.
#include "kernels/attention_latent.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "kernels/exp.h"
#include "kernels/kernel_set.h"

namespace r3::kernels {
namespace {

// A paged latent cache of `positions` rows over shuffled blocks.
template <typename KvT>
struct LatentCache {
  int bs, width;
  std::vector<KvT> rows;
  std::vector<int> table;
  LatentCache(int positions, int block_size, int w, std::mt19937_64& rng)
      : bs(block_size), width(w) {
    const int blocks = (positions + bs - 1) / bs + 2;
    for (int b = 0; b < blocks; ++b) table.push_back(b);
    std::shuffle(table.begin(), table.end(), rng);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t i = 0; i < size_t(blocks) * bs * w; ++i) {
      const float f = normal(rng);
      if constexpr (std::is_same_v<KvT, float>)
        rows.push_back(f);
      else
        rows.push_back(f32_to_bf16(f));
    }
  }
  PagedLatent<KvT> view() const { return {rows.data(), table.data(), bs, width}; }
  float at(int j, int d) const {
    const KvT e =
        rows[(size_t(table[size_t(j / bs)]) * bs + size_t(j % bs)) * size_t(width) + size_t(d)];
    if constexpr (std::is_same_v<KvT, float>)
      return e;
    else
      return bf16_to_f32(e);
  }
};

// The contract for one head: scores by fma over the row in order, times scale; weights
// exp_nonpositive(score - max) summed in key order; out[d] by fma in key order, times 1 / sum.
template <typename KvT>
std::vector<float> contract(const float* q, int value_width, int pos, float scale,
                            const LatentCache<KvT>& c) {
  std::vector<float> s(size_t(pos) + 1), out(size_t(value_width), 0.f);
  float m = -INFINITY;
  for (int j = 0; j <= pos; ++j) {
    float acc = 0.f;
    for (int d = 0; d < c.width; ++d) acc = std::fma(q[d], c.at(j, d), acc);
    s[size_t(j)] = acc * scale;
    m = std::max(m, s[size_t(j)]);
  }
  float sum = 0.f;
  for (float& x : s) sum += (x = exp_nonpositive(x - m));
  for (int j = 0; j <= pos; ++j)
    for (int d = 0; d < value_width; ++d)
      out[size_t(d)] = std::fma(s[size_t(j)], c.at(j, d), out[size_t(d)]);
  for (float& o : out) o *= 1.f / sum;
  return out;
}

template <typename KvT>
void latent_same_bits(std::mt19937_64& rng) {
  const int nh = 20, positions = 61;
  // (latent width, value width): DeepSeek-like (a 128-wide pass), one pass and a tail, tail only.
  for (auto [w, vw] : {std::pair{288, 256}, {208, 200}, {40, 24}})
    for (int bs : {16, 5}) {
      const LatentCache<KvT> cache(positions, bs, w, rng);
      std::normal_distribution<float> normal(0.f, 1.f);
      std::vector<float> q(size_t(nh) * size_t(w));
      for (float& x : q) x = normal(rng);
      for (int pos : {0, 6, 8, 23, 60}) {
        std::vector<std::vector<float>> want;
        for (int h = 0; h < nh; ++h)
          want.push_back(contract(&q[size_t(h) * size_t(w)], vw, pos, 0.09f, cache));
        // Head groups as the runner forms them (at most kLatentHeads a call), and single heads.
        const std::vector<std::vector<int>> groupings = {
            {0, 16, 20}, {0, 8, 20}, {0, 3, 7, 11, 15, 19, 20}};
        for (const KernelSet* set : supported_kernel_sets())
          for (const auto& bounds : groupings) {
            const int stride = pos + 1 + 3;
            std::vector<float> out(size_t(nh) * size_t(vw), -1.f),
                scores(size_t(kLatentHeads) * size_t(stride));
            for (size_t g = 0; g + 1 < bounds.size(); ++g) {
              if constexpr (std::is_same_v<KvT, float>)
                set->attend_latent_heads_f32(q.data(), bounds[g], bounds[g + 1], vw, pos, 0.09f,
                                             cache.view(), scores.data(), stride, out.data(),
                                             size_t(vw));
              else
                set->attend_latent_heads_bf16(q.data(), bounds[g], bounds[g + 1], vw, pos, 0.09f,
                                              cache.view(), scores.data(), stride, out.data(),
                                              size_t(vw));
            }
            for (int h = 0; h < nh; ++h)
              for (int d = 0; d < vw; ++d) {
                uint32_t got, expect;
                std::memcpy(&got, &out[size_t(h) * size_t(vw) + size_t(d)], 4);
                std::memcpy(&expect, &want[size_t(h)][size_t(d)], 4);
                ASSERT_EQ(got, expect)
                    << set->name << " w=" << w << " bs=" << bs << " pos=" << pos << " groups of "
                    << bounds[1] - bounds[0] << " head " << h << " d " << d;
              }
          }
      }
    }
}

TEST(LatentAttention, EverySetAndHeadGroupingGivesTheContractsBits) {
  std::mt19937_64 rng(29);
  latent_same_bits<float>(rng);
  latent_same_bits<uint16_t>(rng);
}

}  // namespace
}  // namespace r3::kernels
