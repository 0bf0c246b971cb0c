// The engine's small ops: each vectorised path gives the bits of its scalar twin (a whole array
// takes the AVX-512 path, one element at a time the scalar one), and stays close to the plain
// libm formula the reference forward uses.
#include "kernels/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/dtype.h"
#include "kernels/dot.h"
#include "kernels/exp.h"

namespace r3::kernels {
namespace {

std::vector<float> random_values(int n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

TEST(Ops, SiluMulVectorEqualsScalarAndLibm) {
  std::vector<float> g = random_values(1000, 6.f, 1), u = random_values(1000, 1.f, 2);
  for (float edge :
       {0.f, -0.f, 1e-30f, -1e-30f, 30.f, -30.f, 87.f, -87.f, 88.f, -88.f, 200.f, -200.f})
    g.push_back(edge), u.push_back(1.5f);
  const int n = int(g.size());
  std::vector<float> bulk(static_cast<size_t>(n)), one(1);
  silu_mul(g.data(), u.data(), bulk.data(), n);
  for (int i = 0; i < n; ++i) {
    silu_mul(&g[size_t(i)], &u[size_t(i)], one.data(), 1);
    ASSERT_TRUE(same_bits(bulk[size_t(i)], one[0])) << "g " << g[size_t(i)];
    const double want =
        double(g[size_t(i)]) / (1.0 + std::exp(-double(g[size_t(i)]))) * u[size_t(i)];
    // Below -87 the sigmoid is cut to 0 (exp_nonpositive), where the true value is under 1e-35.
    ASSERT_NEAR(bulk[size_t(i)], want, 4e-7 * std::fabs(want) + 1e-35) << "g " << g[size_t(i)];
  }
  const float nan = NAN, one_f = 1.f;
  silu_mul(&nan, &one_f, one.data(), 1);
  EXPECT_TRUE(std::isnan(one[0]));
}

TEST(Ops, DotF32EqualsPortableOrder) {
  for (int n : {1, 15, 16, 17, 64, 100, 1024, 1031}) {
    std::vector<float> a = random_values(n, 1.f, uint32_t(n)),
                       b = random_values(n, 1.f, uint32_t(n + 1));
    ASSERT_TRUE(same_bits(dot_f32(a.data(), b.data(), n), dot_f32_portable(a.data(), b.data(), n)))
        << "n " << n;
  }
}

TEST(Ops, SumF64IsTheFixedLaneOrder) {
  for (int n : {1, 7, 8, 9, 100, 32000, 32003}) {
    std::vector<float> x = random_values(n, 1.f, uint32_t(n));
    double lanes[8] = {0};
    for (int i = 0; i < n; ++i) lanes[i % 8] += double(x[size_t(i)]);
    const double want = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
                        ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    ASSERT_EQ(sum_f64(x.data(), n), want) << "n " << n;
  }
}

TEST(Ops, ExpBelowMaxVectorEqualsScalar) {
  std::vector<float> x = random_values(4099, 20.f, 3);
  float m = x[0];
  for (float v : x) m = std::max(m, v);
  for (float d : {1.f, 0.7f, 2.5f}) {
    std::vector<float> bulk(x.size());
    exp_below_max(x.data(), int(x.size()), m, d, bulk.data());
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_TRUE(same_bits(bulk[i], exp_nonpositive((x[i] - m) / d))) << i;
      const double want =
          std::exp(double((x[i] - m) / d));  // exp's own error, on the same argument
      ASSERT_NEAR(bulk[i], want, 3e-7 * want + 1e-37);
    }
  }
}

TEST(Ops, RmsNormMatchesTheFormulaForEveryWeightDtype) {
  const int n = 1000;
  std::vector<float> x = random_values(n, 2.f, 4), wf = random_values(n, 1.f, 5);
  std::vector<uint16_t> wb(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    wb[size_t(i)] = f32_to_bf16(wf[size_t(i)]), wf[size_t(i)] = bf16_to_f32(wb[size_t(i)]);
  TensorView f32_view, bf16_view;
  f32_view.dtype = DType::F32, f32_view.shape = {n}, f32_view.data = wf.data();
  bf16_view.dtype = DType::BF16, bf16_view.shape = {n}, bf16_view.data = wb.data();
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
  rms_norm(x.data(), f32_view, 0, n, 1e-6f, a.data());
  rms_norm(x.data(), bf16_view, 0, n, 1e-6f, b.data());
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double inv = 1.0 / std::sqrt(ss / n + 1e-6);
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(same_bits(a[size_t(i)], b[size_t(i)]));
    ASSERT_NEAR(a[size_t(i)], x[size_t(i)] * inv * wf[size_t(i)],
                1e-5 * std::fabs(x[size_t(i)] * inv * wf[size_t(i)]) + 1e-30);
  }
}

}  // namespace
}  // namespace r3::kernels
