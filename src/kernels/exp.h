// exp(x) for x <= 0, the softmax weight of attention: a fixed Cephes-style polynomial whose scalar
// and AVX-512 versions (attention.cc) run the same operations in the same order, so both give
// the same bits (std::exp differs between libm versions and has no vector twin).
// Accuracy: within 2 ulp of exp for x in [-87, 0]; below -87 (weights under 1.7e-38 next to the
// max's 1) the result is 0.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace r3::kernels {

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

}  // namespace r3::kernels
