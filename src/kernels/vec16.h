// 16 fp32 lanes: one AVX-512 register, or two AVX2 registers (lanes 0-7 and 8-15) applying the
// same per-lane operation to each half. Kernels written once on Vec16 give the same bits on
// both, and the same bits as a scalar loop doing each lane's operations in the same order.
// R3_VEC16 is defined where one of the two is available (else use the scalar paths).
#pragma once
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define R3_VEC16 1
#include <immintrin.h>

namespace r3::kernels {

struct Vec16 {
#if defined(__AVX512F__)
  __m512 v;
#else
  __m256 lo, hi;
#endif

  static Vec16 zero() {
#if defined(__AVX512F__)
    return {_mm512_setzero_ps()};
#else
    return {_mm256_setzero_ps(), _mm256_setzero_ps()};
#endif
  }
  static Vec16 set1(float x) {
#if defined(__AVX512F__)
    return {_mm512_set1_ps(x)};
#else
    return {_mm256_set1_ps(x), _mm256_set1_ps(x)};
#endif
  }
  static Vec16 load(const float* p) {
#if defined(__AVX512F__)
    return {_mm512_loadu_ps(p)};
#else
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
#endif
  }
  // 16 bf16 values (raw bits), widened exactly: the bits become the high half of each lane.
  static Vec16 load(const uint16_t* p) {
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
#else
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
#endif
  }
  void store(float* p) const {
#if defined(__AVX512F__)
    _mm512_storeu_ps(p, v);
#else
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
#endif
  }
};

// a * b + c per lane, rounded once.
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
#if defined(__AVX512F__)
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
#else
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
#endif
}

inline Vec16 operator*(Vec16 a, Vec16 b) {
#if defined(__AVX512F__)
  return {_mm512_mul_ps(a.v, b.v)};
#else
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
#endif
}

}  // namespace r3::kernels
#endif
