// Paged attention computes exactly its documented order (scores: fma over d in order, times the
// scale; softmax in absolute position order; values fma-accumulated per position), so the
// vectorised block path (block size 16) and the portable path give the same bits.
#include "kernels/attention.h"
#include "core/dtype.h"
#include "kernels/exp.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

namespace r3::kernels {
namespace {

std::vector<float> reference(const std::vector<float>& q, const std::vector<std::vector<float>>& k,
                             const std::vector<std::vector<float>>& v, int pos, float scale) {
  const int hd = int(q.size());
  std::vector<float> s(static_cast<size_t>(pos) + 1), out(static_cast<size_t>(hd), 0.f);
  float m = -INFINITY;
  for (int j = 0; j <= pos; ++j) {
    float acc = 0.f;
    for (int d = 0; d < hd; ++d) acc = std::fma(q[size_t(d)], k[size_t(j)][size_t(d)], acc);
    s[size_t(j)] = acc * scale;
    m = std::max(m, s[size_t(j)]);
  }
  float lanes[16] = {0};  // weight j into lane j % 16, then the pairwise tree
  for (int j = 0; j <= pos; ++j) lanes[j % 16] += exp_nonpositive(s[size_t(j)] - m);
  const float sum = ((lanes[0] + lanes[8]) + (lanes[4] + lanes[12])) +
                    ((lanes[2] + lanes[10]) + (lanes[6] + lanes[14])) +
                    (((lanes[1] + lanes[9]) + (lanes[5] + lanes[13])) +
                     ((lanes[3] + lanes[11]) + (lanes[7] + lanes[15])));
  for (int j = 0; j <= pos; ++j) {
    const float w = exp_nonpositive(s[size_t(j)] - m);
    for (int d = 0; d < hd; ++d)
      out[size_t(d)] = std::fma(w, v[size_t(j)][size_t(d)], out[size_t(d)]);
  }
  for (auto& o : out) o *= 1.f / sum;
  return out;
}

// A paged cache of fp32 or bf16 elements in the layouts of attention.h; at(kind, j, e) reads
// key/value j, kv element e back as fp32.
template <typename KvT>
struct Cache {
  int bs, kv_dim, hd;
  std::vector<int> table;
  std::vector<KvT> k, v;
  Cache(int bs_, int kv_dim_, int hd_, std::vector<int> table_)
      : bs(bs_),
        kv_dim(kv_dim_),
        hd(hd_),
        table(std::move(table_)),
        k(table.size() * bs * kv_dim),
        v(k.size()) {}
  size_t k_index(int j, int e) const {
    return (size_t(table[size_t(j / bs)]) * kv_dim + e) * bs + j % bs;
  }                                     // [block][kv_dim][slot]
  size_t v_index(int j, int e) const {  // [block][kv_head][slot][head_dim]
    return (size_t(table[size_t(j / bs)]) * kv_dim + size_t(e / hd * hd)) * bs +
           size_t(j % bs) * hd + e % hd;
  }
  static KvT store(float x) {
    if constexpr (std::is_same_v<KvT, float>)
      return x;
    else
      return f32_to_bf16(x);
  }
  static float load(KvT x) {
    if constexpr (std::is_same_v<KvT, float>)
      return x;
    else
      return bf16_to_f32(x);
  }
  void set(int j, int e, float kv, float vv) {
    k[k_index(j, e)] = store(kv), v[v_index(j, e)] = store(vv);
  }
  float key(int j, int e) const { return load(k[k_index(j, e)]); }
  float value(int j, int e) const { return load(v[v_index(j, e)]); }
  PagedHead<KvT> head(int h) const {
    return {k.data(), v.data(), table.data(), bs, kv_dim, int64_t(h) * hd};
  }
};

// A cache of `blocks` blocks in shuffled pool order, every key and value drawn from N(0, 1).
template <typename KvT>
Cache<KvT> random_cache(int bs, int kv_dim, int hd, int blocks, std::mt19937& rng) {
  std::normal_distribution<float> nd(0, 1);
  std::vector<int> table(static_cast<size_t>(blocks));
  for (int b = 0; b < blocks; ++b) table[size_t(b)] = b;
  std::shuffle(table.begin(), table.end(), rng);
  Cache<KvT> cache(bs, kv_dim, hd, table);
  for (int j = 0; j < blocks * bs; ++j)
    for (int e = 0; e < kv_dim; ++e) cache.set(j, e, nd(rng), nd(rng));
  return cache;
}

template <typename KvT>
void expect_documented_order() {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0, 1);
  for (int bs : {16, 32, 64, 8, 5})  // 1, 2 and 4 lane groups per block; the portable path
    for (int hd : {48, 64, 40}) {    // 3 and 4 vectors of 16, and the portable tail path
      const int kv_heads = 2, kv_dim = hd * kv_heads, pos = 200;
      const int blocks = (pos + bs) / bs;
      std::vector<int> table(static_cast<size_t>(blocks));
      for (int b = 0; b < blocks; ++b)
        table[size_t(b)] = (b * 11 + 3) % blocks;  // 11 is prime to every count here
      std::shuffle(table.begin(), table.end(), rng);
      Cache<KvT> cache(bs, kv_dim, hd, table);
      const int head = 1;
      std::vector<std::vector<float>> k(size_t(pos) + 1, std::vector<float>(size_t(hd))), v = k;
      for (int j = 0; j <= pos; ++j)
        for (int e = 0; e < kv_dim; ++e) {
          cache.set(j, e, nd(rng), nd(rng));
          if (e / hd == head)
            k[size_t(j)][size_t(e % hd)] = cache.key(j, e),
                                    v[size_t(j)][size_t(e % hd)] = cache.value(j, e);
        }
      std::vector<float> q(static_cast<size_t>(hd));
      for (auto& x : q) x = nd(rng);
      // Partial and full blocks, up to 4 lane groups at once on the vector path.
      for (int p : {0, 1, bs - 1, bs, 40, 16 * 11 + 4, pos}) {
        std::vector<float> scores(static_cast<size_t>(pos + bs + 1)), out(static_cast<size_t>(hd));
        attend(q.data(), hd, p, 0.125f, cache.head(head), scores.data(), out.data());
        std::vector<float> want = reference(q, k, v, p, 0.125f);
        for (int d = 0; d < hd; ++d) {
          uint32_t a, b;
          std::memcpy(&a, &out[size_t(d)], 4);
          std::memcpy(&b, &want[size_t(d)], 4);
          ASSERT_EQ(a, b) << "block size " << bs << " head_dim " << hd << " pos " << p << " d "
                          << d;
        }
      }
    }
}

TEST(Attention, PagedEqualsDocumentedOrderBitForBit) { expect_documented_order<float>(); }

// A bf16 cache: the same order over the widened elements.
TEST(Attention, Bf16CacheEqualsDocumentedOrderBitForBit) { expect_documented_order<uint16_t>(); }

// A group shares K and V loads only: each query's output is attend()'s, bit for bit, whatever
// the group size, order and spread of positions.
template <typename KvT>
void expect_group_equals_one_at_a_time() {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0, 1);
  for (int bs : {16, 64, 8})
    for (int hd : {64, 128, 48}) {
      const int kv_dim = 2 * hd, max_pos = 300, blocks = (max_pos + bs) / bs;
      const Cache<KvT> cache = random_cache<KvT>(bs, kv_dim, hd, blocks, rng);
      const PagedHead<KvT> ph = cache.head(1);
      const int stride = max_pos + bs + 1;
      for (const std::vector<int>& pos :
           std::vector<std::vector<int>>{{0},
                                         {5, 6},
                                         {14, 15, 16, 17},
                                         {200, 201, 202},
                                         {299, 3, 150, 47},
                                         {31, 32, 33, 34},
                                         {40, 41, 42, 43, 44},
                                         {7, 250, 33, 34, 35, 299},
                                         {100, 7, 250, 33, 34, 35, 299},
                                         {120, 121, 122, 123, 124, 125, 126, 127},
                                         {299, 0, 64, 63, 17, 200, 16, 1}}) {
        const int nq = int(pos.size());
        std::vector<float> qv(size_t(nq) * hd), got(size_t(nq) * hd), scores(size_t(nq) * stride);
        for (auto& x : qv) x = nd(rng);
        const float* qs[kMaxGroup];
        float* os[kMaxGroup];
        for (int i = 0; i < nq; ++i)
          qs[i] = qv.data() + size_t(i) * hd, os[i] = got.data() + size_t(i) * hd;
        attend_group(qs, pos.data(), nq, hd, 0.125f, ph, scores.data(), stride, os);
        for (int i = 0; i < nq; ++i) {
          std::vector<float> one(static_cast<size_t>(hd)), s1(static_cast<size_t>(stride));
          attend(qs[i], hd, pos[size_t(i)], 0.125f, ph, s1.data(), one.data());
          ASSERT_EQ(0, std::memcmp(one.data(), os[i], size_t(hd) * 4))
              << "block size " << bs << " head_dim " << hd << " query " << i << " of " << nq;
        }
      }
    }
}

TEST(Attention, GroupEqualsOneQueryAtATime) {
  expect_group_equals_one_at_a_time<float>();
  expect_group_equals_one_at_a_time<uint16_t>();
}

// All heads of a token in one walk over the blocks: each head's output is attend()'s on its kv
// head, bit for bit, for any head range, GQA group, block size, head_dim, window and sinks.
template <typename KvT>
void expect_heads_equal_one_head_at_a_time() {
  std::mt19937 rng(13);
  std::normal_distribution<float> nd(0, 1);
  for (int bs : {16, 32, 8})
    for (int hd : {64, 128, 48, 40})
      for (int group : {1, 2, 4}) {
        const int kv_heads = 4, heads = kv_heads * group, kv_dim = kv_heads * hd, max_pos = 260;
        const Cache<KvT> cache = random_cache<KvT>(bs, kv_dim, hd, (max_pos + bs) / bs, rng);
        std::vector<float> q(size_t(heads) * hd), sinks(static_cast<size_t>(heads));
        for (auto& x : q) x = nd(rng);
        for (auto& x : sinks) x = nd(rng);
        const int stride = max_pos + bs + 1;
        for (int pos : {0, 5, bs, 16 * 9 + 3, max_pos})
          for (int window : {0, 37})
            for (bool with_sinks : {false, true})
              for (auto [h0, h1] : std::vector<std::pair<int, int>>{
                       {0, heads}, {1, heads - 1}, {group, 2 * group}}) {
                if (h0 >= h1) continue;
                PagedHead<KvT> layer = cache.head(0);
                layer.window = window;
                std::vector<float> got(q.size(), -1.f), scores(size_t(h1 - h0) * stride);
                attend_heads(q.data(), h0, h1, group, hd, pos, 0.125f, layer,
                             with_sinks ? sinks.data() : nullptr, scores.data(), stride,
                             got.data());
                for (int h = h0; h < h1; ++h) {
                  PagedHead<KvT> one = cache.head(h / group);
                  one.window = window;
                  one.has_sink = with_sinks, one.sink = sinks[size_t(h)];
                  std::vector<float> want(static_cast<size_t>(hd)), s1(static_cast<size_t>(stride));
                  attend(q.data() + size_t(h) * hd, hd, pos, 0.125f, one, s1.data(), want.data());
                  ASSERT_EQ(0,
                            std::memcmp(want.data(), got.data() + size_t(h) * hd, size_t(hd) * 4))
                      << "block size " << bs << " head_dim " << hd << " group " << group << " pos "
                      << pos << " window " << window << " sinks " << with_sinks << " heads [" << h0
                      << ", " << h1 << ") head " << h;
                }
                for (int h = 0; h < heads; ++h)  // heads outside the range are not written
                  if (h < h0 || h >= h1) {
                    ASSERT_EQ(got[size_t(h) * hd], -1.f) << "head " << h;
                  }
              }
      }
}

TEST(Attention, HeadsOfATokenEqualOneHeadAtATime) {
  expect_heads_equal_one_head_at_a_time<float>();
  expect_heads_equal_one_head_at_a_time<uint16_t>();
}

TEST(Attention, ExpWithinTwoUlpOfLibm) {
  for (float x = 0.f; x >= kExpMin; x = x * 1.0001f - 1e-4f) {
    const float got = exp_nonpositive(x), want = std::exp(x);
    ASSERT_LE(std::fabs(got - want), 2 * (std::nextafter(want, INFINITY) - want)) << "x " << x;
  }
  EXPECT_EQ(exp_nonpositive(0.f), 1.f);
  EXPECT_EQ(exp_nonpositive(-88.f), 0.f);
  EXPECT_EQ(exp_nonpositive(-INFINITY), 0.f);
}

}  // namespace
}  // namespace r3::kernels
