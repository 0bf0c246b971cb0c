// exp(x) for x <= 0, the weights of every softmax the engine takes (attention, router, sampling)
// and SiLU's sigmoid: a fixed Cephes-style polynomial whose scalar, AVX-512 and AVX2 versions
// run the same operations in the same order, so all give the same bits (std::exp differs
// between libm versions and has no vector twin).
// Accuracy: within 2 ulp of exp for x in [-87, 0]; below -87 (weights under 1.7e-38 next to the
// max's 1) the result is 0.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same operations in the same order as the scalar version.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_GE_OQ), y);
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes (AVX2+FMA): the same operations in the same order.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_GE_OQ), y);
}
#endif

// out[i] = exp_nonpositive((x[i] - m) / d) for a max m of x and a divisor d > 0 (a softmax's
// numerators at temperature d). out may be x.
inline void exp_below_max(const float* x, int n, float m, float d, float* out) {
  int i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m), dv = _mm512_set1_ps(d);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, exp_nonpositive16(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), dv)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m), dv = _mm256_set1_ps(d);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, exp_nonpositive8(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), dv)));
#endif
  for (; i < n; ++i) out[i] = exp_nonpositive((x[i] - m) / d);
}

}  // namespace r3::kernels
