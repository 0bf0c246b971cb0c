#include "kernels/matmul.h"

#include "core/dtype.h"
#include "kernels/dot.h"

namespace r3::kernels {

namespace {

#if defined(__AVX512F__)
// Four tokens against one weight row: the weight row is loaded once, each token keeps its own
// accumulator, so per-token results are those of dot_portable.
template <bool kBf16>
inline void row_x4(const void* wrow, const float* x0, const float* x1, const float* x2,
                   const float* x3, int n, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 w = kBf16 ? load_bf16x16(static_cast<const uint16_t*>(wrow) + i)
                     : _mm512_loadu_ps(static_cast<const float*>(wrow) + i);
    a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x0 + i), a0);
    a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x1 + i), a1);
    a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x2 + i), a2);
    a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(x3 + i), a3);
  }
  if (i < n) {
    __mmask16 m = __mmask16((1u << (n - i)) - 1);
    __m512 w = kBf16 ? load_bf16x16_masked(static_cast<const uint16_t*>(wrow) + i, m)
                     : _mm512_maskz_loadu_ps(m, static_cast<const float*>(wrow) + i);
    a0 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x0 + i), a0);
    a1 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x1 + i), a1);
    a2 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x2 + i), a2);
    a3 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x3 + i), a3);
  }
  out[0] = reduce512(a0);
  out[1] = reduce512(a1);
  out[2] = reduce512(a2);
  out[3] = reduce512(a3);
}
#endif

template <bool kBf16>
float row_x1(const void* wrow, const float* x, int n) {
#if defined(__AVX512F__)
  float out[4];
  row_x4<kBf16>(wrow, x, x, x, x, n, out);
  return out[0];
#else
  if (kBf16) {
    const uint16_t* w = static_cast<const uint16_t*>(wrow);
    return dot_portable([w](int i) { return bf16_to_f32(w[i]); }, x, n);
  }
  const float* w = static_cast<const float*>(wrow);
  return dot_portable([w](int i) { return w[i]; }, x, n);
#endif
}

template <bool kBf16>
void matmul_rows_t(const float* x, int T, const TensorView& W, float* y, int ldy, int o_begin,
                   int o_end) {
  const int n = int(W.shape[1]);
  const size_t row_bytes = size_t(n) * (kBf16 ? 2 : 4);
  const uint8_t* base = static_cast<const uint8_t*>(W.data);
  for (int o = o_begin; o < o_end; ++o) {
    const void* wrow = base + size_t(o) * row_bytes;
    int t = 0;
#if defined(__AVX512F__)
    for (; t + 4 <= T; t += 4) {
      float out[4];
      row_x4<kBf16>(wrow, x + size_t(t) * n, x + size_t(t + 1) * n, x + size_t(t + 2) * n,
                    x + size_t(t + 3) * n, n, out);
      for (int j = 0; j < 4; ++j) y[size_t(t + j) * ldy + o] = out[j];
    }
#endif
    for (; t < T; ++t) y[size_t(t) * ldy + o] = row_x1<kBf16>(wrow, x + size_t(t) * n, n);
  }
}

}  // namespace

void matmul_rows(const float* x, int T, const TensorView& W, float* y, int ldy, int o_begin,
                 int o_end) {
  if (W.dtype == DType::BF16)
    matmul_rows_t<true>(x, T, W, y, ldy, o_begin, o_end);
  else
    matmul_rows_t<false>(x, T, W, y, ldy, o_begin, o_end);
}

void matmul(const float* x, int T, const TensorView& W, float* y, ThreadPool* pool) {
  const int O = int(W.shape[0]);
  if (!pool || int64_t(O) * T * W.shape[1] < (1 << 15)) {
    matmul_rows(x, T, W, y, O, 0, O);
    return;
  }
  // Blocks of 16 rows keep writes of different threads off the same cache line.
  const int blocks = (O + 15) / 16;
  pool->parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    matmul_rows(x, T, W, y, O, int(b0 * 16), std::min(O, int(b1 * 16)));
  });
}

void round_rows_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

}  // namespace r3::kernels
