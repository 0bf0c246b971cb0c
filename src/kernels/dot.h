// The fixed reduction orders every engine matmul uses.
//
// bf16 weights (activations are bf16 values too, by the numerics contract): the order of the
// AVX512-BF16 instruction vdpbf16ps applied to one output row: for each input pair q in turn,
// acc += w[2q+1]*x[2q+1], then acc += w[2q]*x[2q] (fp32, round to nearest even, denormals
// flushed to zero). Each SIMD lane holds a different output row, so there is no horizontal sum.
// f32 weights: element i is fused-multiply-added into lane i % 16, then the 16 lanes are summed
// by a fixed pairwise tree.
//
// The vector paths (AVX-512, AVX2+FMA) and the portable paths compute exactly these, so a token's
// result is the same bits with or without the instructions, and whatever the batch.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/vec16.h"

namespace r3::kernels {
inline namespace R3_ISA_NS {

inline float reduce_lanes16(const float* lanes) {
  float a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) a[j] = lanes[j] + lanes[j + 8];
  for (int j = 0; j < 4; ++j) b[j] = a[j] + a[j + 4];
  for (int j = 0; j < 2; ++j) c[j] = b[j] + b[j + 2];
  return c[0] + c[1];
}

// Flush-to-zero of a denormal (sign kept), as vdpbf16ps does on its inputs and outputs.
inline float ftz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.f, x) : x; }

inline float bf16_bits_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// acc + w*x rounded once, flushed to zero when tiny. Tininess is judged as x86 does for FTZ (and
// vdpbf16ps for its outputs): on the result rounded to 24 bits with an unbounded exponent, so
// an exact sum just below FLT_MIN that gradual underflow would round up to FLT_MIN is flushed.
inline float fma_ftz(float w, float x, float acc) {
  const float r = std::fma(w, x, acc);
  const float a = std::fabs(r);
  if (!(a <= FLT_MIN)) return r;  // normal (or NaN)
  if (a < FLT_MIN) return std::copysign(0.f, r);
  // |r| == FLT_MIN. Only small operands can produce a sum within half an ulp below FLT_MIN, and
  // for those a 2^32 scaling is exact and rounds as if the exponent were unbounded.
  if (std::fabs(acc) > 1.f || std::fabs(w) > 0x1p64f) return r;
  const float scaled = std::fma(w * 0x1p32f, x, acc * 0x1p32f);
  return std::fabs(scaled) < 0x1p-94f ? std::copysign(0.f, r) : r;
}

// One lane step of vdpbf16ps: acc += w[1]*x[1]; acc += w[0]*x[0]. Inputs are denormal-flushed,
// each product is exact (a bf16 x bf16 product fits fp32's significand, so fma adds it unrounded),
// each sum is rounded once and flushed to zero if tiny. The AVX-512 kernel computes the same with
// vfmadd under MXCSR FTZ|DAZ.
inline float dp_pair(float acc, const uint16_t* w, const uint16_t* x) {
  const float w1 = ftz(bf16_bits_to_f32(w[1])), x1 = ftz(bf16_bits_to_f32(x[1]));
  const float w0 = ftz(bf16_bits_to_f32(w[0])), x0 = ftz(bf16_bits_to_f32(x[0]));
  acc = fma_ftz(w1, x1, acc);
  acc = fma_ftz(w0, x0, acc);
  return acc;
}

// Portable bf16 dot of one weight row in the order above (n even).
inline float dot_bf16_portable(const uint16_t* w, const uint16_t* x, int n) {
  float acc = 0.f;
  for (int q = 0; q < n; q += 2) acc = dp_pair(acc, w + q, x + q);
  return acc;
}

// Portable f32 dot: lane i % 16 with fma, then the tree.
inline float dot_f32_portable(const float* w, const float* x, int n) {
  float lanes[16] = {0};
  for (int i = 0; i < n; ++i) lanes[i % 16] = std::fma(w[i], x[i], lanes[i % 16]);
  return reduce_lanes16(lanes);
}

#if R3_ISA_AVX512
// The tree of reduce_lanes16, vectorised (float addition is commutative, so same bits).
inline float reduce512(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
#endif

// f32 dot in the order of dot_f32_portable, vectorised where the CPU has AVX-512 or AVX2+FMA.
inline float dot_f32(const float* a, const float* b, int n) {
#if defined(R3_VEC16)
  Vec16 acc = Vec16::zero();
  int i = 0;
  for (; i + 16 <= n; i += 16) acc = fmadd(Vec16::load(a + i), Vec16::load(b + i), acc);
  float lanes[16];
  acc.store(lanes);
  for (; i < n; ++i) lanes[i % 16] = std::fma(a[i], b[i], lanes[i % 16]);
  return reduce_lanes16(lanes);
#else
  return dot_f32_portable(a, b, n);
#endif
}

}  // namespace R3_ISA_NS
}  // namespace r3::kernels
