// 16 fp32 lanes: one AVX-512 register, or two AVX2 registers (lanes 0-7 and 8-15) applying the
// same per-lane operation to each half. Kernels written once on Vec16 give the same bits on
// both, and the same bits as a scalar loop doing each lane's operations in the same order.
// R3_VEC16 is defined where one of the two is available (else use the scalar paths).
#pragma once
#include <cstdint>

#include "kernels/isa.h"

#if R3_ISA_AVX2
#define R3_VEC16 1
// GCC 12 reports the _mm512_undefined_* inside its own AVX-512 headers as uninitialised (GCC bug
// 105593) when AVX-512 is enabled by -m flags; the report points into the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace r3::kernels {
inline namespace R3_ISA_NS {

struct Vec16 {
#if R3_ISA_AVX512
  __m512 v;
#else
  __m256 lo, hi;
#endif

  static Vec16 zero() {
#if R3_ISA_AVX512
    return {_mm512_setzero_ps()};
#else
    return {_mm256_setzero_ps(), _mm256_setzero_ps()};
#endif
  }
  static Vec16 set1(float x) {
#if R3_ISA_AVX512
    return {_mm512_set1_ps(x)};
#else
    return {_mm256_set1_ps(x), _mm256_set1_ps(x)};
#endif
  }
  static Vec16 load(const float* p) {
#if R3_ISA_AVX512
    return {_mm512_loadu_ps(p)};
#else
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
#endif
  }
  // 16 bf16 values (raw bits), widened exactly: the bits become the high half of each lane.
  static Vec16 load(const uint16_t* p) {
#if R3_ISA_AVX512
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
#else
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
#endif
  }
  void store(float* p) const {
#if R3_ISA_AVX512
    _mm512_storeu_ps(p, v);
#else
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
#endif
  }
};

// Lane j of v in every lane.
inline Vec16 broadcast_lane(Vec16 v, int j) {
#if R3_ISA_AVX512
  return {_mm512_permutexvar_ps(_mm512_set1_epi32(j), v.v)};
#else
  const __m256 half = j < 8 ? v.lo : v.hi;
  const __m256 b = _mm256_permutevar8x32_ps(half, _mm256_set1_epi32(j & 7));
  return {b, b};
#endif
}

// a * b + c per lane, rounded once.
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
#if R3_ISA_AVX512
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
#else
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
#endif
}

// Lane-wise arithmetic, each operation rounded once as its scalar counterpart. min(a, b) and
// max(a, b) are a < b ? a : b and a > b ? a : b, b where either is NaN (vminps / vmaxps), so
// min(limit, x) is std::min(x, limit) and max(lo, x) the lower half of std::clamp, NaN kept.
#if R3_ISA_AVX512
#define R3_VEC16_BINARY(name, fn) \
  inline Vec16 name(Vec16 a, Vec16 b) { return {_mm512_##fn##_ps(a.v, b.v)}; }
#else
#define R3_VEC16_BINARY(name, fn)                                        \
  inline Vec16 name(Vec16 a, Vec16 b) {                                  \
    return {_mm256_##fn##_ps(a.lo, b.lo), _mm256_##fn##_ps(a.hi, b.hi)}; \
  }
#endif
R3_VEC16_BINARY(operator+, add)
R3_VEC16_BINARY(operator-, sub)
R3_VEC16_BINARY(operator*, mul)
R3_VEC16_BINARY(operator/, div)
R3_VEC16_BINARY(min, min)
R3_VEC16_BINARY(max, max)
#undef R3_VEC16_BINARY

inline Vec16 abs(Vec16 a) {
#if R3_ISA_AVX512
  return {_mm512_abs_ps(a.v)};
#else
  const __m256 sign = _mm256_set1_ps(-0.f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
#endif
}

// To the nearest integer, ties to even (std::nearbyint under the default rounding mode).
inline Vec16 round_nearest(Vec16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if R3_ISA_AVX512
  return {_mm512_roundscale_ps(a.v, kMode)};
#else
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
#endif
}

// 2^n for lanes holding integers n in [-126, 127] (the exponent field built directly).
#if !R3_ISA_AVX512
// (A function, not a lambda: GCC gives a lambda's function-pointer thunk no target pragma.)
inline __m256 pow2_half(__m256 x) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(x), _mm256_set1_epi32(127)), 23));
}
#endif
inline Vec16 pow2(Vec16 n) {
#if R3_ISA_AVX512
  return {_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
#else
  return {pow2_half(n.lo), pow2_half(n.hi)};
#endif
}

// Per lane: a >= b (false where either is NaN) ? if_ge : otherwise.
inline Vec16 select_ge(Vec16 a, Vec16 b, Vec16 if_ge, Vec16 otherwise) {
#if R3_ISA_AVX512
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ), otherwise.v, if_ge.v)};
#else
  return {_mm256_blendv_ps(otherwise.lo, if_ge.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ)),
          _mm256_blendv_ps(otherwise.hi, if_ge.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ))};
#endif
}

}  // namespace R3_ISA_NS
}  // namespace r3::kernels
#endif
