// exp(x) for x <= 0, the weights of every softmax the engine takes (attention, router, sampling)
// and SiLU's sigmoid: a fixed Cephes-style polynomial whose scalar and Vec16 (AVX-512 or AVX2)
// versions run the same operations in the same order, so all give the same bits (std::exp differs
// between libm versions and has no vector twin).
// Accuracy: within 2 ulp of exp for x in [-87, 0]; below -87 (weights under 1.7e-38 next to the
// max's 1) the result is 0.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/vec16.h"

namespace r3::kernels {
inline namespace R3_ISA_NS {

inline constexpr float kExpLog2e = 1.44269504088896341f;
inline constexpr float kExpLn2Hi = 0.693359375f;     // ln 2 = hi + lo, hi with few mantissa bits
inline constexpr float kExpLn2Lo = -2.12194440e-4f;  // so n * hi is exact
inline constexpr float kExpMin = -87.f;
inline constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  if (!(x >= kExpMin)) return 0.f;
  const float n = std::nearbyint(x * kExpLog2e);
  float r = std::fma(n, -kExpLn2Hi, x);
  r = std::fma(n, -kExpLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  float y = std::fma(p, r * r, r) + 1.f;
  const uint32_t bits = uint32_t(int(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

#if defined(R3_VEC16)
// exp_nonpositive on 16 lanes: the same operations in the same order as the scalar version.
inline Vec16 exp_nonpositive(Vec16 x) {
  const Vec16 n = round_nearest(x * Vec16::set1(kExpLog2e));
  Vec16 r = fmadd(n, Vec16::set1(-kExpLn2Hi), x);
  r = fmadd(n, Vec16::set1(-kExpLn2Lo), r);
  Vec16 p = Vec16::set1(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = fmadd(p, r, Vec16::set1(kExpPoly[i]));
  const Vec16 y = (fmadd(p, r * r, r) + Vec16::set1(1.f)) * pow2(n);
  return select_ge(x, Vec16::set1(kExpMin), y, Vec16::zero());
}
#endif

// sigmoid(x) from e = exp(-|x|) <= 1: 1 / (1 + e) for x >= 0 and e / (1 + e) below, so the
// exponential never overflows (SiLU, the sigmoid routers, the shared-expert gate).
inline float sigmoid(float x) {
  const float e = exp_nonpositive(0.f - std::fabs(x));
  return (x >= 0.f ? 1.f : e) / (1.f + e);
}

// out[i] = exp_nonpositive((x[i] - m) / d) for a max m of x and a divisor d > 0 (a softmax's
// numerators at temperature d). out may be x.
inline void exp_below_max(const float* x, int n, float m, float d, float* out) {
  int i = 0;
#if defined(R3_VEC16)
  const Vec16 mv = Vec16::set1(m), dv = Vec16::set1(d);
  for (; i + 16 <= n; i += 16) exp_nonpositive((Vec16::load(x + i) - mv) / dv).store(out + i);
#endif
  for (; i < n; ++i) out[i] = exp_nonpositive((x[i] - m) / d);
}

}  // namespace R3_ISA_NS
}  // namespace r3::kernels
