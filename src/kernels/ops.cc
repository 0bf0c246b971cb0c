// The per-token ops of ops.h, compiled once per instruction set (isa.h). RoPE is in rope.cc.
#include "kernels/ops.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/isa_entry_points.h"

// Compiled for this file's instruction set from here on (isa.h).
// clang-format off
#include "kernels/isa_begin.h"
#include "kernels/dot.h"
#include "kernels/exp.h"
// clang-format on

namespace r3::kernels {
inline namespace R3_ISA_NS {

void rms_norm(const float* x, const TensorView& w, int64_t w_offset, int n, float eps, float* y,
              float offset) {
  const float inv = 1.f / std::sqrt(dot_f32(x, x, n) / float(n) + eps);
  if (w.dtype == DType::F32) {
    const float* wf = static_cast<const float*>(w.data) + w_offset;
    for (int i = 0; i < n; ++i) y[i] = x[i] * inv * (offset + wf[i]);
  } else if (w.dtype == DType::BF16) {
    const uint16_t* wb = static_cast<const uint16_t*>(w.data) + w_offset;
    for (int i = 0; i < n; ++i) y[i] = x[i] * inv * (offset + bf16_to_f32(wb[i]));
  } else {
    for (int i = 0; i < n; ++i) y[i] = x[i] * inv * (offset + w.at(w_offset + i));
  }
}

template <typename BiasT>
void add_stored_bias(float* x, const BiasT* b, int n) {
  int i = 0;
#if defined(R3_VEC16)
  for (; i + 16 <= n; i += 16) (Vec16::load(x + i) + Vec16::load(b + i)).store(x + i);
#endif
  for (; i < n; ++i) x[i] += widen(b[i]);
}

void add_bias(float* x, const TensorView& b, int64_t b_offset, int n) {
  if (b.dtype == DType::F32)
    add_stored_bias(x, static_cast<const float*>(b.data) + b_offset, n);
  else if (b.dtype == DType::BF16)
    add_stored_bias(x, static_cast<const uint16_t*>(b.data) + b_offset, n);
  else
    for (int i = 0; i < n; ++i) x[i] += b.at(b_offset + i);
}

// silu(g) = g * sigmoid(g), sigmoid as exp.h computes it (the vector path the same operations).
void silu_mul(const float* gate, const float* up, float* out, int n) {
  int i = 0;
#if defined(R3_VEC16)
  const Vec16 one = Vec16::set1(1.f), zero = Vec16::zero();
  for (; i + 16 <= n; i += 16) {
    const Vec16 g = Vec16::load(gate + i);
    const Vec16 e = exp_nonpositive(zero - abs(g));
    const Vec16 sig = select_ge(g, zero, one, e) / (one + e);
    (g * sig * Vec16::load(up + i)).store(out + i);
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = g * sigmoid(g) * up[i];
  }
}

// The same sigmoid (exp.h); the vector path the same operations in the same order.
void clamped_swiglu(const float* gate, const float* up, float* out, int n, float limit,
                    float alpha) {
  int i = 0;
#if defined(R3_VEC16)
  const Vec16 one = Vec16::set1(1.f), zero = Vec16::zero(), hi = Vec16::set1(limit),
              lo = Vec16::set1(-limit), a = Vec16::set1(alpha);
  for (; i + 16 <= n; i += 16) {
    const Vec16 g = min(hi, Vec16::load(gate + i)), u = min(hi, max(lo, Vec16::load(up + i)));
    const Vec16 x = g * a;
    const Vec16 e = exp_nonpositive(zero - abs(x));
    const Vec16 sig = select_ge(x, zero, one, e) / (one + e);
    ((u + one) * (g * sig)).store(out + i);
  }
#endif
  for (; i < n; ++i) {
    const float g = std::min(gate[i], limit), u = std::clamp(up[i], -limit, limit);
    out[i] = (u + 1.f) * (g * sigmoid(g * alpha));
  }
}

// f32_to_bf16 (core/dtype.h) per lane: round to nearest even, a NaN kept quiet. Not
// vcvtneps2bf16, which flushes subnormal inputs to zero.
void round_to_bf16(float* x, int64_t n, uint16_t* bits) {
  int64_t i = 0;
#if R3_ISA_AVX512
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1),
                quiet = _mm512_set1_epi32(0x40);
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i b = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(hi, one))), 16);
    b = _mm512_mask_mov_epi32(b, nan, _mm512_or_si512(hi, quiet));
    _mm512_storeu_si512(x + i, _mm512_slli_epi32(b, 16));
    if (bits) _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + i), _mm512_cvtepi32_epi16(b));
  }
#elif R3_ISA_AVX2
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1),
                quiet = _mm256_set1_epi32(0x40);
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    // Signed compare is right here: |u| and inf are both below 2^31.
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i b = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(hi, one))), 16);
    b = _mm256_blendv_epi8(b, _mm256_or_si256(hi, quiet), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), _mm256_slli_epi32(b, 16));
    if (bits) {
      // Each lane's value is below 2^16, so the unsigned pack is exact; it interleaves 128-bit
      // halves.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(bits + i), _mm256_castsi256_si128(packed));
    }
  }
#endif
  for (; i < n; ++i) {
    const uint16_t b = f32_to_bf16(x[i]);
    x[i] = bf16_to_f32(b);
    if (bits) bits[i] = b;
  }
}

void softmax(const float* x, int n, float* out) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
  exp_below_max(x, n, m, 1.f, out);
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += out[i];
  for (int i = 0; i < n; ++i) out[i] /= s;
}

double sum_f64(const float* x, int n) {
  int i = 0;
#if R3_ISA_AVX512
  __m512d acc = _mm512_setzero_pd();
  for (; i + 8 <= n; i += 8) acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_loadu_ps(x + i)));
  double lanes[8];
  _mm512_storeu_pd(lanes, acc);
#elif defined(R3_VEC16)  // AVX2+FMA (kernels/vec16.h brings the intrinsics)
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();  // lanes 0-3 and 4-7
  for (; i + 8 <= n; i += 8) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm_loadu_ps(x + i)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4)));
  }
  double lanes[8];
  _mm256_storeu_pd(lanes, lo);
  _mm256_storeu_pd(lanes + 4, hi);
#else
  double lanes[8] = {0};
#endif
  for (; i < n; ++i) lanes[i % 8] += double(x[i]);
  double a[4], b[2];
  for (int j = 0; j < 4; ++j) a[j] = lanes[j] + lanes[j + 4];
  for (int j = 0; j < 2; ++j) b[j] = a[j] + a[j + 2];
  return b[0] + b[1];
}

}  // namespace R3_ISA_NS
}  // namespace r3::kernels

#include "kernels/isa_end.h"
