#include "kernels/matmul.h"

#include <algorithm>
#include <type_traits>

#include "core/dtype.h"
#include "kernels/dot.h"

namespace r3::kernels {

namespace {

// ---- bf16 weights: R weight rows x C tokens, vdpbf16ps order ----

template <int R, int C>
void tile_bf16(const uint16_t* w, size_t ldw, const uint16_t* x, size_t ldx, int n, float* y, int ldy) {
#if defined(__AVX512BF16__)
  __m512 acc[R][C];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512i wv[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w + r * ldw + i);
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i xv = _mm512_loadu_si512(x + c * ldx + i);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  if (i < n) {
    const __mmask32 m = __mmask32((uint64_t(1) << (n - i)) - 1);
    __m512i wv[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(m, w + r * ldw + i);
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i xv = _mm512_maskz_loadu_epi16(m, x + c * ldx + i);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[size_t(c) * ldy + r] = reduce512(acc[r][c]);
#else
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[size_t(c) * ldy + r] = dot_bf16_portable(w + r * ldw, x + c * ldx, n);
#endif
}

// ---- f32 weights: lane i % 16 fma order ----

template <int R, int C>
void tile_f32(const float* w, size_t ldw, const float* x, size_t ldx, int n, float* y, int ldy) {
#if defined(__AVX512F__)
  __m512 acc[R][C];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 wv[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * ldw + i);
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_loadu_ps(x + c * ldx + i);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    __m512 wv[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(m, w + r * ldw + i);
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + c * ldx + i);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[size_t(c) * ldy + r] = reduce512(acc[r][c]);
#else
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[size_t(c) * ldy + r] = dot_f32_portable(w + r * ldw, x + c * ldx, n);
#endif
}

template <typename T, int R>
using TileFn = void (*)(const T*, size_t, const T*, size_t, int, float*, int);

// Rows in blocks of R (remainder one by one), tokens in blocks of 4 (remainder 1..3).
template <typename T, template <int, int> class Tile>
void run_tiles(const T* w, const T* x, int Tn, int n, float* y, int ldy, int o0, int o1) {
  const size_t ldw = size_t(n), ldx = size_t(n);
  auto rows_block = [&](auto r_const, int o) {
    constexpr int R = decltype(r_const)::value;
    const T* wr = w + size_t(o) * ldw;
    int t = 0;
    for (; t + 4 <= Tn; t += 4) Tile<R, 4>::run(wr, ldw, x + size_t(t) * ldx, ldx, n, y + size_t(t) * ldy + o, ldy);
    switch (Tn - t) {
      case 3: Tile<R, 3>::run(wr, ldw, x + size_t(t) * ldx, ldx, n, y + size_t(t) * ldy + o, ldy); break;
      case 2: Tile<R, 2>::run(wr, ldw, x + size_t(t) * ldx, ldx, n, y + size_t(t) * ldy + o, ldy); break;
      case 1: Tile<R, 1>::run(wr, ldw, x + size_t(t) * ldx, ldx, n, y + size_t(t) * ldy + o, ldy); break;
      default: break;
    }
  };
  int o = o0;
  for (; o + 4 <= o1; o += 4) rows_block(std::integral_constant<int, 4>{}, o);
  for (; o < o1; ++o) rows_block(std::integral_constant<int, 1>{}, o);
}

template <int R, int C>
struct Bf16Tile {
  static void run(const uint16_t* w, size_t ldw, const uint16_t* x, size_t ldx, int n, float* y, int ldy) {
    tile_bf16<R, C>(w, ldw, x, ldx, n, y, ldy);
  }
};
template <int R, int C>
struct F32Tile {
  static void run(const float* w, size_t ldw, const float* x, size_t ldx, int n, float* y, int ldy) {
    tile_f32<R, C>(w, ldw, x, ldx, n, y, ldy);
  }
};

}  // namespace

void matmul_rows(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin, int o_end) {
  const int n = int(W.shape[1]);
  if (W.dtype == DType::BF16)
    run_tiles<uint16_t, Bf16Tile>(static_cast<const uint16_t*>(W.data), x.bf16, x.rows, n, y, ldy, o_begin, o_end);
  else
    run_tiles<float, F32Tile>(static_cast<const float*>(W.data), x.f32, x.rows, n, y, ldy, o_begin, o_end);
}

void matmul(const Activations& x, const TensorView& W, float* y, ThreadPool* pool) {
  const int O = int(W.shape[0]);
  if (!pool || int64_t(O) * x.rows * W.shape[1] < (1 << 16)) {
    matmul_rows(x, W, y, O, 0, O);
    return;
  }
  // Blocks of 16 rows keep writes of different threads off the same cache line.
  const int blocks = (O + 15) / 16;
  pool->parallel_for_each(blocks, [&](int64_t b) {
    matmul_rows(x, W, y, O, int(b * 16), std::min(O, int(b * 16 + 16)));
  });
}

void round_to_bf16(float* x, int64_t n, uint16_t* bits) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = f32_to_bf16(x[i]);
    x[i] = bf16_to_f32(b);
    if (bits) bits[i] = b;
  }
}

}  // namespace r3::kernels
