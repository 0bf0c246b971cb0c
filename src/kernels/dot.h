// The one reduction every engine matmul uses: a dot product with a fixed order. Element i goes
// to lane i % 16 (fused multiply-add), then the 16 lanes are summed by a fixed pairwise tree.
// The AVX-512 path and the portable path compute exactly this, so results are the same bits on
// the same machine with or without AVX-512, whatever the batch.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace r3::kernels {

inline float reduce_lanes16(const float* lanes) {
  float a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) a[j] = lanes[j] + lanes[j + 8];
  for (int j = 0; j < 4; ++j) b[j] = a[j] + a[j + 4];
  for (int j = 0; j < 2; ++j) c[j] = b[j] + b[j + 2];
  return c[0] + c[1];
}

#if defined(__AVX512F__)
inline float reduce512(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  return reduce_lanes16(lanes);
}
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load_bf16x16_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

// Portable reference for the lane order (also used where AVX-512 is absent).
template <typename LoadW>
inline float dot_portable(LoadW w, const float* x, int n) {
  float lanes[16] = {0};
  for (int i = 0; i < n; ++i) lanes[i % 16] = std::fma(w(i), x[i], lanes[i % 16]);
  return reduce_lanes16(lanes);
}

}  // namespace r3::kernels
