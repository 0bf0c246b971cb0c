// The matmul tiles (matmul.h), compiled once per instruction set (isa.h).
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/isa_entry_points.h"
#include "kernels/tile_choice.h"

// Compiled for this file's instruction set from here on (isa.h).
// clang-format off
#include "kernels/isa_begin.h"
#include "kernels/dot.h"
// clang-format on

namespace r3::kernels {
inline namespace R3_ISA_NS {

namespace {

// ---- bf16 weights: P panels of 16 rows x C tokens, lanes = rows ----
//
// vfmadd or vdpbf16ps (kDp): the same per-row order (dot.h). vfmadd has twice the throughput
// where the CPU issues vdpbf16ps at half the FMA rate (Sapphire/Emerald Rapids), vdpbf16ps where
// it issues it at full rate (Zen 4): tile_choice.h times both on the machine. A panel's 64-byte
// pair row holds 16 dwords (w[2q] low, w[2q+1] high): a shift and a mask widen them to two fp32
// vectors.

constexpr int kPanel = kPanelRows;
// Each pair row of a panel is one cache line; prefetching 32 lines ahead per panel keeps enough
// misses in flight for one core to stream near the machine's bandwidth (the hardware prefetcher
// alone stops at every 4 KiB page). The lines are requested into L2 (prefetcht1): requested into
// L1 they take its few miss buffers from the loads, and the streams fell 10-25% further short of
// the read bandwidth (BM_MoeLayer, BM_MoeLayerMxfp4, BM_MoeLayerFp8 at 1 token an expert).
constexpr int kPrefetchPairs = 32;
constexpr ptrdiff_t kPrefetchBytes = ptrdiff_t(kPrefetchPairs) * 64;
inline void prefetch_stream(const void* at) {
  _mm_prefetch(static_cast<const char*>(at), _MM_HINT_T1);
}

#if R3_ISA_AVX2
// FTZ|DAZ for the kernel's duration: vdpbf16ps flushes its inputs and outputs, fma then does too.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};
#endif

#if R3_ISA_AVX512
// Pair row q of one panel (16 rows x 2 bf16, one cache line), prefetching the line `ahead`
// elements further on.
inline __m512i pair_row(const uint16_t* panel, int q, ptrdiff_t ahead) {
  const uint16_t* at = panel + size_t(q) * 32;
  prefetch_stream(at + ahead);
  return _mm512_loadu_si512(at);
}

// Lane masks of P panels' rows inside [lo, hi).
template <int P>
inline void panel_row_masks(int row0, int lo, int hi, __mmask16* masks) {
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    const int r0 = row0 + p * kPanel;
    const int a = std::max(lo, r0) - r0, b = std::min(hi, r0 + kPanel) - r0;
    masks[p] = a < b ? __mmask16(((1u << b) - 1) & ~((1u << a) - 1)) : __mmask16(0);
  }
}

// One input pair of C tokens into P x C accumulators: w[2q + 1] x[2q + 1] first, then
// w[2q] x[2q] (the per-row order of dot.h).
template <int P, int C>
inline void fma_pair(const __m512* w0, const __m512* w1, const float* const* xf, int q,
                     __m512 (*acc)[C]) {
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const __m512 x1 = _mm512_set1_ps(xf[c][2 * size_t(q) + 1]);
    const __m512 x0 = _mm512_set1_ps(xf[c][2 * size_t(q)]);
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[p][c] = _mm512_fmadd_ps(w1[p], x1, acc[p][c]);
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[p][c] = _mm512_fmadd_ps(w0[p], x0, acc[p][c]);
  }
}

#if R3_ISA_AVX512BF16
// The same pair with vdpbf16ps on bf16 pair rows w (xb: the C tokens' bf16 rows).
template <int P, int C>
inline void dp_pair(const __m512i* w, const uint16_t* const* xb, int q, __m512 (*acc)[C]) {
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    uint32_t pair;
    std::memcpy(&pair, xb[c] + 2 * size_t(q), 4);
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(pair));
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[p][c] = _mm512_dpbf16_ps(acc[p][c], (__m512bh)w[p], xv);
  }
}
#endif

template <int P, int C>
inline void store_panels(float* y, int t0, int ldy, int row0, const __mmask16* masks,
                         const __m512 (*acc)[C]) {
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      _mm512_mask_storeu_ps(y + size_t(t0 + c) * ldy + row0 + p * kPanel, masks[p], acc[p][c]);
}
#endif

// P panels x C tokens over input pairs [q0, q1): starts from zero at q0 = 0, else from the
// partial sums already in y (the same fp32 chain, so splitting the pairs changes no bit), and
// stores only rows [lo, hi) (masked at the edges of the range). kDp: the same sums with
// vdpbf16ps itself, one instruction per 64 weight bytes and token instead of four: always for
// single tokens (pure weight streaming), for more where tile_choice.h found it faster.
template <int P, int C, bool kDp>
void panel_tile(const uint16_t* panels, size_t panel_elems, const Activations& x, int t0, int pairs,
                int q0, int q1, ptrdiff_t ahead, float* y, int ldy, int row0, int lo, int hi) {
  const size_t ldx = size_t(2) * size_t(pairs);
#if R3_ISA_AVX512
  const float* xf[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) xf[c] = x.f32 + size_t(x.row(t0 + c)) * ldx;
  __m512 acc[P][C];
  __mmask16 rows_mask[P];
  panel_row_masks<P>(row0, lo, hi, rows_mask);
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      acc[p][c] = q0 == 0 ? _mm512_setzero_ps()
                          : _mm512_maskz_loadu_ps(rows_mask[p],
                                                  y + size_t(t0 + c) * ldy + row0 + p * kPanel);
#if R3_ISA_AVX512BF16
  if constexpr (kDp) {
    const uint16_t* xb[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) xb[c] = x.bf16 + size_t(x.row(t0 + c)) * ldx;
    for (int q = q0; q < q1; ++q) {
      __m512i w[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) w[p] = pair_row(panels + size_t(p) * panel_elems, q, ahead);
      dp_pair<P, C>(w, xb, q, acc);
    }
  } else
#endif
  {
    const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
    for (int q = q0; q < q1; ++q) {
      __m512 w0[P], w1[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512i w = pair_row(panels + size_t(p) * panel_elems, q, ahead);
        w1[p] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
        w0[p] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      }
      fma_pair<P, C>(w0, w1, xf, q, acc);
    }
  }
  store_panels<P, C>(y, t0, ldy, row0, rows_mask, acc);
#elif R3_ISA_AVX2
  // 8 lanes: each panel's 16 rows are two halves (pair row bytes 0-31 and 32-63), otherwise
  // the same per-row fma order as the AVX-512 path.
  const float* xf[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) xf[c] = x.f32 + size_t(x.row(t0 + c)) * ldx;
  __m256 acc[P][C][2];
  __m256i rows_mask[P][2];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int h = 0; h < 2; ++h) {
      const int r0 = row0 + p * kPanel + 8 * h;
      const __m256i lane =
          _mm256_add_epi32(_mm256_set1_epi32(r0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      rows_mask[p][h] = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(lo - 1)),
                                         _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane));
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[p][c][h] = q0 == 0 ? _mm256_setzero_ps()
                               : _mm256_maskload_ps(y + size_t(t0 + c) * ldy + r0, rows_mask[p][h]);
    }
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  for (int q = q0; q < q1; ++q) {
    __m256 w0[P][2], w1[P][2];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const uint16_t* at = panels + size_t(p) * panel_elems + size_t(q) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(at + ahead), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 16 * h));
        w1[p][h] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        w0[p][h] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 x1 = _mm256_set1_ps(xf[c][2 * size_t(q) + 1]);
      const __m256 x0 = _mm256_set1_ps(xf[c][2 * size_t(q)]);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) acc[p][c][h] = _mm256_fmadd_ps(w1[p][h], x1, acc[p][c][h]);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) acc[p][c][h] = _mm256_fmadd_ps(w0[p][h], x0, acc[p][c][h]);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        _mm256_maskstore_ps(y + size_t(t0 + c) * ldy + row0 + p * kPanel + 8 * h, rows_mask[p][h],
                            acc[p][c][h]);
#else
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < kPanel; ++r) {
      const int row = row0 + p * kPanel + r;
      if (row < lo || row >= hi) continue;
      for (int c = 0; c < C; ++c) {
        float acc = q0 == 0 ? 0.f : y[size_t(t0 + c) * ldy + row];
        for (int q = q0; q < q1; ++q)
          acc = dp_pair(acc, panels + size_t(p) * panel_elems + size_t(q) * 32 + size_t(r) * 2,
                        x.bf16 + size_t(x.row(t0 + c)) * ldx + 2 * size_t(q));
        y[size_t(t0 + c) * ldy + row] = acc;
      }
    }
#endif
}

// fn.template operator()<C>() for a run-time width 1..kMax: a tile width as a template argument.
template <int kMax, typename Fn>
inline void with_width(int width, Fn fn) {
  [&]<int... C>(std::integer_sequence<int, C...>) {
    ((width == C + 1 ? fn.template operator()<C + 1>() : void()), ...);
  }
  (std::make_integer_sequence<int, kMax>{});
}

// Tiles of up to kMaxC of `rows` tokens: fn(t, width) for each. A last tile of few tokens keeps
// few chains in flight: it and the last full tile become two of about equal width instead (a
// token's sums do not depend on its tile).
template <int kMaxC, typename Fn>
inline void token_tiles(int rows, Fn fn) {
  int full = rows / kMaxC, rest = rows % kMaxC, t = 0;
  const bool even_out = full > 0 && rest > 0 && rest < kMaxC - 2;
  if (even_out) --full, rest += kMaxC;
  for (int i = 0; i < full; ++i, t += kMaxC) fn(t, kMaxC);
  if (even_out) {
    fn(t, rest - rest / 2);
    fn(t + rest - rest / 2, rest / 2);
  } else if (rest > 0) {
    fn(t, rest);
  }
}

// Pairs per chunk when several token tiles share the panels: P panels x this many pairs is
// 32 KiB, so every tile after the first finds its weights in L1 (48 KiB here).
template <int P>
constexpr int kChunkPairs = 512 / P;

// All tokens against P panels: tiles of up to kMaxC tokens (token_tiles).
// With more than one tile the input pairs go in chunks, every tile through one chunk before
// the next chunk; the first tile of a chunk streams it in, the others (whose weights are in
// L1) prefetch the next chunk, or the next panels after the last chunk, so the weight stream
// overlaps their arithmetic.
//
// One tile (x.rows <= kMaxC) streams the panels once; with `more` panels following in the range,
// its last kPrefetchPairs pair rows prefetch the next pass's panels (P on) instead of the next
// panel of this pass, so the next pass does not start on cold misses (its two halves chain
// through y: the same sums).
template <int P, int kMaxC, bool kDp>
void panel_tokens(const uint16_t* panels, size_t panel_elems, const Activations& x, int pairs,
                  float* y, int ldy, int row0, int lo, int hi, bool more = false) {
  const ptrdiff_t streaming = ptrdiff_t(kPrefetchPairs) * 32;
  if (P > 1 && x.rows <= kMaxC && more && pairs > kPrefetchPairs) {
    const int wrap = pairs - kPrefetchPairs;
    [&]<int... C>(std::integer_sequence<int, C...>) {
      ((x.rows == C + 1
            ? (panel_tile<P, C + 1, kDp>(panels, panel_elems, x, 0, pairs, 0, wrap, streaming, y,
                                         ldy, row0, lo, hi),
               panel_tile<P, C + 1, kDp>(panels, panel_elems, x, 0, pairs, wrap, pairs,
                                         streaming + ptrdiff_t(P - 1) * ptrdiff_t(panel_elems), y,
                                         ldy, row0, lo, hi))
            : void()),
       ...);
    }
    (std::make_integer_sequence<int, kMaxC>{});
    return;
  }
  const int chunk = x.rows > kMaxC ? kChunkPairs<P> : pairs;
  for (int q0 = 0; q0 < pairs; q0 += chunk) {
    const int q1 = std::min(pairs, q0 + chunk);
    const ptrdiff_t next =
        q1 < pairs ? ptrdiff_t(q1 - q0) * 32 : ptrdiff_t(P * panel_elems) - ptrdiff_t(q0) * 32;
    token_tiles<kMaxC>(x.rows, [&](int t, int width) {
      with_width<kMaxC>(width, [&]<int C>() {
        panel_tile<P, C, kDp>(panels, panel_elems, x, t, pairs, q0, q1, t == 0 ? streaming : next,
                              y, ldy, row0, lo, hi);
      });
    });
  }
}

// Panels touching [o_begin, o_end), as many at a time as the widest tile allows (P, then P/2...):
// up to 6 tokens take 4 panels in one pass (each weight line read once; 4 streams keep enough
// misses in flight); more take 2 panels x 8 tokens (one weight load feeds 8 tokens).
template <int P, int kMaxC, bool kDp>
int panels_from(const Activations& x, const uint16_t* packed, int pairs, float* y, int ldy, int p,
                int p_end, int lo, int hi) {
  const size_t panel_elems = size_t(pairs) * 32;
  for (; p + P <= p_end; p += P)
    panel_tokens<P, kMaxC, kDp>(packed + size_t(p) * panel_elems, panel_elems, x, pairs, y, ldy,
                                p * kPanel, lo, hi, p + P < p_end);
  if constexpr (P > 1)
    p = panels_from<P / 2, kMaxC, kDp>(x, packed, pairs, y, ldy, p, p_end, lo, hi);
  return p;
}

// vdpbf16ps tiles (kDp): always for single tokens (pure weight streaming), for more where
// tile_choice.h found them faster on this CPU. Both give the same bits.
inline bool use_dp_tiles(int rows) {
#if R3_ISA_AVX512BF16
  return rows < 2 || bf16_tiles() == Bf16Tiles::DotProduct;
#else
  (void)rows;
  return false;
#endif
}

// fn(std::bool_constant<dp>{}): a run-time tile choice as a template argument.
template <typename Fn>
inline void with_dp_tiles(bool dp, Fn fn) {
  if (dp)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

void matmul_packed(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                   int o_end) {
#if R3_ISA_AVX2
  const FlushDenormals ftz_daz;
#endif
  const int hi = std::min(o_end, int(W.shape[0])), pairs = int(W.shape[1]) / 2;
  const int p = o_begin / kPanel, p_end = (hi + kPanel - 1) / kPanel;
#if R3_ISA_AVX2 && !R3_ISA_AVX512
  // 16 ymm registers: one panel (two halves) x up to 4 tokens.
  panels_from<1, 4, false>(x, W.packed, pairs, y, ldy, p, p_end, o_begin, hi);
#else
  with_dp_tiles(use_dp_tiles(x.rows), [&](auto dp) {
    if (x.rows < 2)
      panels_from<4, 1, dp>(x, W.packed, pairs, y, ldy, p, p_end, o_begin, hi);
    else if (x.rows < 7)
      panels_from<4, 6, dp>(x, W.packed, pairs, y, ldy, p, p_end, o_begin, hi);
    else
      panels_from<2, 8, dp>(x, W.packed, pairs, y, ldy, p, p_end, o_begin, hi);
  });
#endif
}

// ---- f32 weights: lane i % 16 fma order ----

// R weight rows x C activation rows (xs: the C rows' data).
template <int R, int C>
void tile_f32(const float* w, size_t ldw, const float* const* xs, int n, float* y, int ldy) {
#if R3_ISA_AVX512
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
      const __m512 xv = _mm512_loadu_ps(xs[c] + i);
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
      const __m512 xv = _mm512_maskz_loadu_ps(m, xs[c] + i);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[size_t(c) * ldy + r] = reduce512(acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[size_t(c) * ldy + r] = dot_f32_portable(w + r * ldw, xs[c], n);
#endif
}

// ---- Quantized weights: each panel decoded into bf16 pair rows, then the bf16 tiles ----

// Panels touching [o_begin, hi) of a quantized weight: decode(p, out) writes panel p as bf16
// pair rows (the bf16 panel of the decoded weights), which the bf16 tiles then read from L2.
// From 7 tokens on (AVX-512 and portable) two panels are decoded at a time for the 2-panel x
// 8-token tiles matmul_packed runs there, so each token's broadcast serves two panels.
template <typename Decode>
void decoded_panels(const Activations& x, int pairs, float* y, int ldy, int o_begin, int hi,
                    Decode decode) {
  const size_t panel_elems = size_t(pairs) * 32;
#if R3_ISA_AVX2 && !R3_ISA_AVX512
  constexpr int at_once = 1;
#else
  const int at_once = x.rows < 7 ? 1 : 2;
#endif
  thread_local PackedBf16 decoded;  // at_once panels as bf16 pair rows (they stay in L2)
  if (decoded.size() < at_once * panel_elems) decoded.resize(at_once * panel_elems);
  const int p_end = (hi + kPanel - 1) / kPanel;
  for (int p = o_begin / kPanel; p < p_end; p += at_once) {
    const int n = std::min(at_once, p_end - p);
    for (int i = 0; i < n; ++i) decode(p + i, decoded.data() + size_t(i) * panel_elems);
#if R3_ISA_AVX2 && !R3_ISA_AVX512
    panel_tokens<1, 4, false>(decoded.data(), panel_elems, x, pairs, y, ldy, p * kPanel, o_begin,
                              hi);
#else
    with_dp_tiles(use_dp_tiles(x.rows), [&](auto dp) {
      if (x.rows < 2)
        panel_tokens<1, 1, dp>(decoded.data(), panel_elems, x, pairs, y, ldy, p * kPanel, o_begin,
                               hi);
      else if (x.rows < 7)
        panel_tokens<1, 6, dp>(decoded.data(), panel_elems, x, pairs, y, ldy, p * kPanel, o_begin,
                               hi);
      else if (n == 2)
        panel_tokens<2, 8, dp>(decoded.data(), panel_elems, x, pairs, y, ldy, p * kPanel, o_begin,
                               hi);
      else
        panel_tokens<1, 8, dp>(decoded.data(), panel_elems, x, pairs, y, ldy, p * kPanel, o_begin,
                               hi);
    });
#endif
  }
}

#if R3_ISA_AVX512
// The start of a fused-decode tile of P panels x C tokens: the tokens' fp32 rows, the panels'
// row masks within [lo, hi), zeroed sums.
template <int P, int C>
inline void fused_tile_start(const Activations& x, int t0, size_t ldx, int row0, int lo, int hi,
                             const float** xf, __mmask16* rows_mask, __m512 (*acc)[C]) {
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) xf[c] = x.f32 + size_t(x.row(t0 + c)) * ldx;
  panel_row_masks<P>(row0, lo, hi, rows_mask);
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[p][c] = _mm512_setzero_ps();
}

// Panels [p, p_end) x all tokens for a tile with the decode fused in, P panels at a time (each
// a weight stream in flight), tokens in tiles of up to kMaxC (token_tiles), each tile decoding
// the panels again (the later ones read them from L1 or L2): tile.template operator()<P, C>(p, t).
template <int P, int kMaxC, typename Tile>
int fused_panels_from(int rows, int p, int p_end, const Tile& tile) {
  for (; p + P <= p_end; p += P)
    token_tiles<kMaxC>(rows, [&](int t, int width) {
      with_width<kMaxC>(width, [&]<int C>() { tile.template operator()<P, C>(p, t); });
    });
  if constexpr (P > 1) p = fused_panels_from<P / 2, kMaxC>(rows, p, p_end, tile);
  return p;
}

// The MXFP4 fused tiles' shapes: below 4 tokens, 4 panels (4 streams in flight) x up to 3
// tokens; from 4 on, 2 panels x up to 8 tokens, so that each decoded pair row feeds more tokens
// and the sums still fit the registers.
template <typename Tile>
void mxfp4_decode_tiles(int rows, int p, int p_end, const Tile& tile) {
  if (rows < 4)
    fused_panels_from<4, 3>(rows, p, p_end, tile);
  else
    fused_panels_from<2, 8>(rows, p, p_end, tile);
}
#endif

// ---- MXFP4 weights: 4-bit panels decoded one panel at a time into bf16 pair rows ----
//
// The panel layout (matmul.h, pack_mxfp4): groups of 16 pair rows as four 64-byte lines (word
// 2r + h of line m holds row r's codes of input 2q + h for pair rows 4m..4m + 3, a nibble each),
// each group followed by the rows' scales. Decoding is exact:
// the e2m1 value as bf16 bits, its exponent field moved by scale - 127 (the loader keeps every
// result a normal number); zero stays zero. The decoded pair rows are the bf16 panel of the
// same weights, so the tiles and their bits are the bf16 ones.

constexpr uint16_t kE2m1Bf16[16] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

#if R3_ISA_AVX512
// The e2m1 table as bf16 words, twice: vpermw reads an index's low 5 bits.
inline __m512i mxfp4_bf16_table() {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kE2m1Bf16)));
}
// A group's 16 scale bytes as the exponent step (scale - 127) << 7 in both words of row r's dword.
inline __m512i mxfp4_exponent_steps(const uint8_t* scales) {
  const __m512i k = _mm512_slli_epi32(
      _mm512_sub_epi32(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales))),
          _mm512_set1_epi32(127)),
      7);
  return _mm512_or_si512(_mm512_and_si512(k, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(k, 16));
}
// One pair row as bf16 pair row words from a group line shifted to it (codes: word 2r + h holds
// row r's input 2q + h at bits 0-3, matmul.h): the table gives each e2m1 value's bf16 bits and a
// nonzero magnitude's exponent moves by its row's step (exact: the loader keeps every result a
// normal number).
inline __m512i mxfp4_pair_row_bf16(__m512i codes, __m512i table, __m512i steps) {
  const __m512i v = _mm512_permutexvar_epi16(codes, table);
  return _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(codes, _mm512_set1_epi16(7)), v, steps);
}
#endif

void decode_mxfp4_panel(const uint8_t* panel, int pairs, uint16_t* out) {
  constexpr int kG = kMxfp4GroupPairs;
#if R3_ISA_AVX512
  const __m512i table = mxfp4_bf16_table();
  for (int g = 0; g < pairs / kG; ++g) {
    const uint8_t* group = panel + size_t(g) * kMxfp4GroupBytes;
    const __m512i steps = mxfp4_exponent_steps(group + kG * 16);
    for (int m = 0; m < kG / 4; ++m) {
      _mm_prefetch(reinterpret_cast<const char*>(group + m * 64 + 1024), _MM_HINT_T0);
      const __m512i line = _mm512_loadu_si512(group + m * 64);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k)
        _mm512_storeu_si512(out + size_t(g * kG + 4 * m + k) * 32,
                            mxfp4_pair_row_bf16(_mm512_srli_epi16(line, 4 * k), table, steps));
    }
  }
#elif R3_ISA_AVX2
  // 8 lanes: the magnitude from an 8-entry table, the sign bit moved into place; dword r of a
  // line's half holds row r's two words (inputs 2q and 2q + 1).
  const __m256i lut =
      _mm256_setr_epi32(0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0);
  const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8),
                zero = _mm256_setzero_si256();
  auto decode = [&](__m256i n, __m256i k) {  // the code in n's bits 0-3
    const __m256i mag = _mm256_permutevar8x32_epi32(lut, _mm256_and_si256(n, seven));
    const __m256i nonzero = _mm256_xor_si256(_mm256_cmpeq_epi32(mag, zero), _mm256_set1_epi32(-1));
    const __m256i scaled = _mm256_add_epi32(mag, _mm256_and_si256(k, nonzero));
    return _mm256_or_si256(scaled, _mm256_slli_epi32(_mm256_and_si256(n, eight), 12));
  };
  for (int g = 0; g < pairs / kG; ++g) {
    const uint8_t* group = panel + size_t(g) * kMxfp4GroupBytes;
    for (int h = 0; h < 2; ++h) {
      const __m256i k = _mm256_slli_epi32(
          _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                               reinterpret_cast<const __m128i*>(group + kG * 16 + 8 * h))),
                           _mm256_set1_epi32(127)),
          7);
      for (int m = 0; m < kG / 4; ++m) {
        const __m256i d =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + m * 64 + 32 * h));
        for (int j = 0; j < 4; ++j) {
          const __m256i lo = decode(_mm256_srli_epi32(d, 4 * j), k),
                        hi = decode(_mm256_srli_epi32(d, 16 + 4 * j), k);
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(out + size_t(g * kG + 4 * m + j) * 32 + 16 * h),
              _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
        }
      }
    }
  }
#else
  for (int q = 0; q < pairs; ++q) {
    const uint8_t* group = panel + size_t(q / kG) * kMxfp4GroupBytes;
    const int j = q % kG;
    for (int r = 0; r < kPanel; ++r) {
      const int k = (int(group[kG * 16 + r]) - 127) * 128;
      for (int h = 0; h < 2; ++h) {
        const uint16_t v = kE2m1Bf16[(group[mxfp4_code_byte(j, r, h)] >> mxfp4_code_shift(j)) & 15];
        out[size_t(q) * 32 + size_t(r) * 2 + size_t(h)] = uint16_t(v & 0x7fff ? v + k : v);
      }
    }
  }
#endif
}

#if R3_ISA_AVX512
// Tokens up to which the quantized weights' fused tiles (MXFP4, FP8) run. Each tile of up to 8
// tokens decodes the weights again, which costs less than decoding a panel once into a bf16
// copy up to about 16 tokens and more beyond (BM_MoeLayerMxfp4 and BM_MoeLayerFp8, /16 and /32).
constexpr int kFusedDecodeTokens = 16;

// Up to kFusedDecodeTokens tokens (decode): the decode fused into the tile, no bf16 copy, the bf16
// tile's per-row order (w[2q + 1] x[2q + 1] first, then w[2q] x[2q]), so the bits are the bf16
// path's. kDp: each pair row decoded to bf16 words (mxfp4_pair_row_bf16) and one vdpbf16ps per
// token; else lane r's weights as fp32, its e2m1 value times 2^(scale - 127) (an exact product,
// built from the scale byte as an fp32 exponent), and two fma. Near a panel's end the prefetch
// moves on to the same panel of the next pass (`next_panels` of them follow in this range), so a
// pass does not start on cold misses.
template <int P, int C, bool kDp>
void mxfp4_tile(const uint8_t* panels, size_t panel_bytes, int next_panels, const Activations& x,
                int t0, int pairs, float* y, int ldy, int row0, int lo, int hi) {
  constexpr int kG = kMxfp4GroupPairs;
  const size_t ldx = size_t(2) * size_t(pairs);
  const float* xf[C];
  __m512 acc[P][C];
  __mmask16 rows_mask[P];
  fused_tile_start<P, C>(x, t0, ldx, row0, lo, hi, xf, rows_mask, acc);
  [[maybe_unused]] const uint16_t* xb[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) xb[c] = x.bf16 + size_t(x.row(t0 + c)) * ldx;
  [[maybe_unused]] const __m512i table = mxfp4_bf16_table();
  const __m512 lut = _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f,
                                    -1.5f, -2.f, -3.f, -4.f, -6.f);
  // One prefetch per 64 bytes of a panel's stream, kPrefetchBytes ahead; past the panel's end it
  // lands P panels on, on the same panel of the next pass.
  auto prefetch = [&](int p, size_t offset) {
    const uint8_t* at = panels + size_t(p) * panel_bytes + offset + kPrefetchBytes;
    if (offset + kPrefetchBytes < panel_bytes)
      prefetch_stream(at);
    else if (p < next_panels)
      prefetch_stream(at + size_t(P - 1) * panel_bytes);
  };
  for (int g = 0; g < pairs / kG; ++g) {
    const size_t group = size_t(g) * kMxfp4GroupBytes;
    __m512i scale[P];  // kDp: exponent steps; else 2^(scale - 127) as fp32 bits
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      prefetch(p, group + kG * 16);
      const uint8_t* bytes = panels + size_t(p) * panel_bytes + group + kG * 16;
      if constexpr (kDp)
        scale[p] = mxfp4_exponent_steps(bytes);
      else
        scale[p] = _mm512_slli_epi32(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))), 23);
    }
    for (int m = 0; m < kG / 4; ++m) {  // the group's lines: pair rows 4m..4m + 3 each
      __m512i line[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        prefetch(p, group + size_t(m) * 64);
        line[p] = _mm512_loadu_si512(panels + size_t(p) * panel_bytes + group + size_t(m) * 64);
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const int q = g * kG + 4 * m + k;
#if R3_ISA_AVX512BF16
        if constexpr (kDp) {
          __m512i w[P];
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p)
            w[p] = mxfp4_pair_row_bf16(_mm512_srli_epi16(line[p], 4 * k), table, scale[p]);
          dp_pair<P, C>(w, xb, q, acc);
          continue;
        }
#endif
        // Dword r holds row r's two words: input 2q's code at bit 4k, 2q + 1's at 16 + 4k;
        // vpermps reads an index's low 4 bits.
        __m512 w0[P], w1[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          w0[p] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(line[p], 4 * k), lut),
                                _mm512_castsi512_ps(scale[p]));
          w1[p] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(line[p], 16 + 4 * k), lut),
                                _mm512_castsi512_ps(scale[p]));
        }
        fma_pair<P, C>(w0, w1, xf, q, acc);
      }
    }
  }
  store_panels<P, C>(y, t0, ldy, row0, rows_mask, acc);
}
#endif

void matmul_mxfp4(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                  int o_end) {
#if R3_ISA_AVX2
  const FlushDenormals ftz_daz;
#endif
  const int hi = std::min(o_end, int(W.shape[0])), pairs = int(W.shape[1]) / 2;
  const auto* packed = reinterpret_cast<const uint8_t*>(W.packed);
  const size_t panel_bytes = mxfp4_panel_bytes(W);
#if R3_ISA_AVX512
  if (x.rows <= kFusedDecodeTokens) {
    const bool dp = use_dp_tiles(x.rows);
    const int p_end = (hi + kPanel - 1) / kPanel;
    auto tile = [&]<int P, int C>(int p, int t) {
      const int next_panels = std::clamp(p_end - (p + P), 0, P);
      with_dp_tiles(dp, [&](auto kDp) {
        mxfp4_tile<P, C, kDp>(packed + size_t(p) * panel_bytes, panel_bytes, next_panels, x, t,
                              pairs, y, ldy, p * kPanel, o_begin, hi);
      });
    };
    mxfp4_decode_tiles(x.rows, o_begin / kPanel, p_end, tile);
    return;
  }
#endif
  // More tokens (prefill): each panel decoded once into bf16 pair rows, then the bf16 tiles.
  decoded_panels(x, pairs, y, ldy, o_begin, hi, [&](int p, uint16_t* out) {
    decode_mxfp4_panel(packed + size_t(p) * panel_bytes, pairs, out);
  });
}

// ---- FP8 weights: 8-bit panels with block scales, decoded through a table per block ----
//
// The panel layout (matmul.h, fp8_code_byte): the codes of pair rows q and q + 1 as one 64-byte
// line, then one fp32 scale per column block (the panel's rows share it: fp8_native). A weight
// decodes to the bf16 rounding (nearest even) of its e4m3 value times its block's scale, an fp32
// product; the loader keeps every nonzero product a normal number, so every path, flushing
// denormals or not, gives these bits. Since the rounding is symmetric, code c decodes to the
// table entry of its magnitude c & 0x7f with c's sign bit: per column block the panel's 128
// entries are computed once, and each code is then a table lookup (a byte permute on AVX-512).

// The e4m3 magnitudes (codes 0..127) as fp32; 127, a NaN the loader refuses, as 0.
struct E4m3Magnitudes {
  alignas(64) float v[128];
  E4m3Magnitudes() {
    for (int m = 0; m < 128; ++m) v[m] = m == 127 ? 0.f : e4m3_to_f32(uint8_t(m));
  }
};
inline const float* e4m3_magnitudes() {
  static const E4m3Magnitudes t;
  return t.v;
}

#if R3_ISA_AVX2
// fp32 -> bf16 bits (round to nearest even) in the low half of each lane; no NaN can occur.
inline __m256i ps_to_bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                           16);
}
#endif

#if R3_ISA_AVX512
// The table of one block scale s: word m of words[m / 32] is the bf16 bits of magnitude m x s.
inline void fp8_word_table(const float* magnitudes, float s, __m512i* words) {
  const __m512 scale = _mm512_set1_ps(s);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512 a = _mm512_mul_ps(_mm512_load_ps(magnitudes + 32 * i), scale);
    const __m512 b = _mm512_mul_ps(_mm512_load_ps(magnitudes + 32 * i + 16), scale);
#if R3_ISA_AVX512BF16
    words[i] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // round to nearest even, a's words first
#else
    alignas(64) float products[32];  // rounded by the per-token op (ops.cc), once per block
    alignas(64) uint16_t bits[32];
    _mm512_store_ps(products, a);
    _mm512_store_ps(products + 16, b);
    round_to_bf16(products, 32, bits);
    words[i] = _mm512_load_si512(bits);
#endif
  }
}

#if R3_ISA_AVX512BF16
// With VBMI (which the avx512bf16 set requires): the table as its entries' low bytes and high
// bytes, 128 of each in two registers, for vpermt2b (which reads an index's low 7 bits).
struct Fp8Table {
  __m512i lo[2], hi[2];
};
inline Fp8Table fp8_table(const float* magnitudes, float s) {
  __m512i words[4];
  fp8_word_table(magnitudes, s, words);
  alignas(64) static constexpr auto kEven = [] {
    std::array<uint8_t, 64> v{};
    for (int j = 0; j < 64; ++j) v[size_t(j)] = uint8_t(2 * j);
    return v;
  }();
  const __m512i even = _mm512_load_si512(kEven.data()),
                odd = _mm512_add_epi8(even, _mm512_set1_epi8(1));
  Fp8Table t;
  for (int i = 0; i < 2; ++i) {
    t.lo[i] = _mm512_permutex2var_epi8(words[2 * i], even, words[2 * i + 1]);
    t.hi[i] = _mm512_permutex2var_epi8(words[2 * i], odd, words[2 * i + 1]);
  }
  return t;
}
// One code line (pair rows q, q + 1) as two bf16 pair rows: each code's entry, its sign bit or-ed
// into the high byte, the bytes interleaved into words (matmul.h: the line's byte order makes
// this the panel's word order).
inline void fp8_pair_rows(__m512i codes, const Fp8Table& t, __m512i& row_q, __m512i& row_q1) {
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], codes, t.lo[1]);
  const __m512i hi =
      _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi[0], codes, t.hi[1]), codes,
                                _mm512_set1_epi8(char(0x80)), 0xf8);  // hi | (codes & 0x80)
  row_q = _mm512_unpacklo_epi8(lo, hi);
  row_q1 = _mm512_unpackhi_epi8(lo, hi);
}
#else
// Without VBMI: the table as 128 words in four registers, looked up with vpermt2w (an index's low
// 6 bits) in each half and the half chosen by bit 6.
struct Fp8Table {
  __m512i words[4];
};
inline Fp8Table fp8_table(const float* magnitudes, float s) {
  Fp8Table t;
  fp8_word_table(magnitudes, s, t.words);
  return t;
}
inline __m512i fp8_pair_row(__m512i codes,
                            const Fp8Table& t) {  // codes: one per word, zero-extended
  const __m512i low = _mm512_permutex2var_epi16(t.words[0], codes, t.words[1]);
  const __m512i high = _mm512_permutex2var_epi16(t.words[2], codes, t.words[3]);
  const __m512i v =
      _mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(codes, _mm512_set1_epi16(0x40)), high);
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(codes, 8), _mm512_set1_epi16(short(0x8000)),
                                   0xf8);
}
inline void fp8_pair_rows(__m512i codes, const Fp8Table& t, __m512i& row_q, __m512i& row_q1) {
  row_q = fp8_pair_row(_mm512_unpacklo_epi8(codes, _mm512_setzero_si512()), t);
  row_q1 = fp8_pair_row(_mm512_unpackhi_epi8(codes, _mm512_setzero_si512()), t);
}
#endif
#elif R3_ISA_AVX2
// e4m3 codes, one per 16-bit word (zero-extended), into half-precision numbers of value x 2^-8:
// the code moved to the high byte and shifted right arithmetically puts its sign at bit 15 (and
// a copy at 14, cleared) and its exponent and mantissa bits in the fp16 fields; the two formats
// differ by their exponent bias only, subnormals included. vcvtph2ps then widens exactly (it
// never flushes), and the block scale is taken x 2^8, so each product is value x scale rounded
// once.
inline __m256i e4m3_to_f16(__m256i words) {
  return _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1),
                          _mm256_set1_epi16(short(0xbfff)));
}
#endif

// One panel's codes decoded into bf16 pair rows (the decoded path: beyond kFusedDecodeTokens on
// AVX-512, at every token count on AVX2 and portable).
void decode_fp8_panel(const uint8_t* panel, size_t scales_at, int pairs, int block_cols,
                      uint16_t* out) {
  const auto* scales = reinterpret_cast<const float*>(panel + scales_at);
  const int pairs_per_block = block_cols / 2;  // even (fp8_native)
  for (int q0 = 0, cb = 0; q0 < pairs; q0 += pairs_per_block, ++cb) {
    const int q1 = std::min(pairs, q0 + pairs_per_block);
#if R3_ISA_AVX512
    const Fp8Table table = fp8_table(e4m3_magnitudes(), scales[cb]);
    for (int q = q0; q < q1; q += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + size_t(q) * 32 + 1024), _MM_HINT_T0);
      __m512i row_q, row_q1;
      fp8_pair_rows(_mm512_loadu_si512(panel + size_t(q) * 32), table, row_q, row_q1);
      _mm512_storeu_si512(out + size_t(q) * 32, row_q);
      if (q + 1 < q1) _mm512_storeu_si512(out + size_t(q + 1) * 32, row_q1);
    }
#elif R3_ISA_AVX2
    const __m256 scale = _mm256_set1_ps(scales[cb] * 256.f);
    for (int q = q0; q < q1; q += 2)
      for (int l = 0; l < 4; ++l) {  // 16 bytes: words 8l..8l + 7 of pair row q, then of q + 1
        const auto* at = reinterpret_cast<const __m128i*>(panel + size_t(q) * 32 + 16 * l);
        const __m256i h = e4m3_to_f16(_mm256_cvtepu8_epi16(_mm_loadu_si128(at)));
        const __m256i a =
            ps_to_bf16_bits(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale));
        const __m256i b =
            ps_to_bf16_bits(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale));
        const __m256i words =
            _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);  // a's 8 words, then b's
        auto* row_q = reinterpret_cast<__m128i*>(out + size_t(q) * 32 + 8 * l);
        _mm_storeu_si128(row_q, _mm256_castsi256_si128(words));
        if (q + 1 < q1)
          _mm_storeu_si128(row_q + 4, _mm256_extracti128_si256(words, 1));  // pair row q + 1
      }
#else
    const float* magnitudes = e4m3_magnitudes();
    uint16_t table[256];
    for (int c = 0; c < 256; ++c)
      table[c] = f32_to_bf16(magnitudes[c & 0x7f] * scales[cb]) | uint16_t((c & 0x80) << 8);
    for (int q = q0; q < q1; ++q)
      for (int w = 0; w < 32; ++w)
        out[size_t(q) * 32 + size_t(w)] = table[panel[fp8_code_byte(q, w / 2, w % 2)]];
#endif
  }
}

#if R3_ISA_AVX512
// Up to kFusedDecodeTokens tokens (decode): the decode fused into the tile, no bf16 copy. Each
// code line gives two bf16 pair rows (fp8_pair_rows), fed to the tokens as the bf16 tile feeds
// its pair rows (vdpbf16ps, or each pair row's two inputs widened to fp32 for two fma), so the
// bits are the bf16 path's.
template <int P, int C>
void fp8_tile(const uint8_t* panels, size_t panel_bytes, size_t scales_at, int block_cols,
              const Activations& x, int t0, int pairs, float* y, int ldy, int row0, int lo,
              int hi) {
  const size_t ldx = size_t(2) * size_t(pairs);
  const float* xf[C];
  __m512 acc[P][C];
  __mmask16 rows_mask[P];
  fused_tile_start<P, C>(x, t0, ldx, row0, lo, hi, xf, rows_mask, acc);
  [[maybe_unused]] const uint16_t* xb[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) xb[c] = x.bf16 + size_t(x.row(t0 + c)) * ldx;
  const float* magnitudes = e4m3_magnitudes();
  const int pairs_per_block = block_cols / 2;  // even (fp8_native)
  for (int q0 = 0, cb = 0; q0 < pairs; q0 += pairs_per_block, ++cb) {
    const int q1 = std::min(pairs, q0 + pairs_per_block);
    Fp8Table table[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
      table[p] = fp8_table(magnitudes, reinterpret_cast<const float*>(
                                           panels + size_t(p) * panel_bytes + scales_at)[cb]);
    for (int q = q0; q < q1; q += 2) {
      __m512i row_q[P], row_q1[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const uint8_t* at = panels + size_t(p) * panel_bytes + size_t(q) * 32;
        prefetch_stream(at + kPrefetchBytes);
        fp8_pair_rows(_mm512_loadu_si512(at), table[p], row_q[p], row_q1[p]);
      }
      auto feed = [&](const __m512i* rows, int pair) {
#if R3_ISA_AVX512BF16
        dp_pair<P, C>(rows, xb, pair, acc);
#else
        __m512 w0[P], w1[P];  // each row's input 2q (low word), 2q + 1 (high word) as fp32
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          w0[p] = _mm512_castsi512_ps(_mm512_slli_epi32(rows[p], 16));
          w1[p] =
              _mm512_castsi512_ps(_mm512_and_si512(rows[p], _mm512_set1_epi32(int(0xffff0000u))));
        }
        fma_pair<P, C>(w0, w1, xf, pair, acc);
#endif
      };
      feed(row_q, q);
      if (q + 1 < q1) feed(row_q1, q + 1);
    }
  }
  store_panels<P, C>(y, t0, ldy, row0, rows_mask, acc);
}
#endif

void matmul_fp8(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                int o_end) {
#if R3_ISA_AVX2
  const FlushDenormals ftz_daz;
#endif
  const int hi = std::min(o_end, int(W.shape[0])), pairs = int(W.shape[1]) / 2;
  const size_t panel_bytes = fp8_panel_bytes(W), scales_at = fp8_scales_offset(W);
  const auto* packed = reinterpret_cast<const uint8_t*>(W.packed);
#if R3_ISA_AVX512
  if (x.rows <= kFusedDecodeTokens) {
    auto tile = [&]<int P, int C>(int p, int t) {
      fp8_tile<P, C>(packed + size_t(p) * panel_bytes, panel_bytes, scales_at, W.block_cols, x, t,
                     pairs, y, ldy, p * kPanel, o_begin, hi);
    };
    // 2 panels x up to 8 tokens at every count: with their tables (4 registers a panel), 4
    // panels would not fit the registers (BM_MoeLayerFp8/1: 1.4x slower).
    fused_panels_from<2, 8>(x.rows, o_begin / kPanel, (hi + kPanel - 1) / kPanel, tile);
    return;
  }
#endif
  // More tokens: each panel decoded once into bf16 pair rows, then the bf16 tiles.
  decoded_panels(x, pairs, y, ldy, o_begin, hi, [&](int p, uint16_t* out) {
    decode_fp8_panel(packed + size_t(p) * panel_bytes, scales_at, pairs, W.block_cols, out);
  });
}

// Rows in blocks of 4 (remainder one by one), tokens in blocks of 4 (remainder 1..3).
void matmul_f32(const float* w, const Activations& x, int n, float* y, int ldy, int o0, int o1) {
  const size_t ldw = size_t(n);
  auto rows_block = [&]<int R>(int o) {
    const float* wr = w + size_t(o) * ldw;
    for (int t = 0; t < x.rows; t += 4) {
      const float* xs[4];
      const int c = std::min(4, x.rows - t);
      for (int k = 0; k < c; ++k) xs[k] = x.f32 + size_t(x.row(t + k)) * size_t(n);
      float* yt = y + size_t(t) * ldy + o;
      switch (c) {
        case 4:
          tile_f32<R, 4>(wr, ldw, xs, n, yt, ldy);
          break;
        case 3:
          tile_f32<R, 3>(wr, ldw, xs, n, yt, ldy);
          break;
        case 2:
          tile_f32<R, 2>(wr, ldw, xs, n, yt, ldy);
          break;
        default:
          tile_f32<R, 1>(wr, ldw, xs, n, yt, ldy);
          break;
      }
    }
  };
  int o = o0;
  for (; o + 4 <= o1; o += 4) rows_block.template operator()<4>(o);
  for (; o < o1; ++o) rows_block.template operator()<1>(o);
}

}  // namespace

// A pair (w[2q], w[2q+1]) moves as one 4-byte word: it is already in the packed order, and pair
// row q of a panel is the 16 rows' words q. With AVX-512, 16 consecutive pair rows come from one
// 64-byte load per weight row and a 16x16 dword transpose in registers (a gather per line costs
// several times the uops, and packing then falls behind the memory); the scalar path moves the
// words in blocks of 64 pairs so the 16 source rows and the block's destination lines stay in L1.
#if R3_ISA_AVX512
namespace {
// r[i] = dwords 0..15 of row i  ->  r[j] = dword j of rows 0..15.
inline void transpose_16x16_dwords(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}
}  // namespace
#endif

void pack_panels(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end) {
  const int64_t O = W.shape[0], I = W.shape[1], pairs = I / 2;
  const auto* w = static_cast<const uint8_t*>(W.data);
  auto* out = reinterpret_cast<uint8_t*>(packed);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const int64_t r0 = p * kPanel, rows = std::min<int64_t>(kPanel, O - r0);
    uint8_t* panel = out + size_t(p * pairs) * 64;
    const uint8_t* first = w + size_t(r0 * I) * 2;
#if R3_ISA_AVX512
    if (rows == kPanel && pairs <= (int64_t(1) << 26)) {
      const bool aligned = reinterpret_cast<uintptr_t>(panel) % 64 == 0;
      const int64_t whole = aligned ? pairs / 16 * 16 : 0;
      for (int64_t q = 0; q < whole; q += 16) {
        __m512i r[16];
        for (int i = 0; i < kPanel; ++i) {
          const uint8_t* src = first + size_t(i * I) * 2 + size_t(q) * 4;
          _mm_prefetch(reinterpret_cast<const char*>(src + 1024),
                       _MM_HINT_T0);  // 16 lines ahead in each row
          r[i] = _mm512_loadu_si512(src);
        }
        transpose_16x16_dwords(r);
        // Whole lines written once: streaming stores skip reading the old panel in.
        for (int j = 0; j < 16; ++j)
          _mm512_stream_si512(reinterpret_cast<__m512i*>(panel + size_t(q + j) * 64), r[j]);
      }
      const __m512i row_offsets = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(int(pairs)));
      for (int64_t q = whole; q < pairs; ++q)
        _mm512_storeu_si512(panel + size_t(q) * 64,
                            _mm512_i32gather_epi32(row_offsets, first + size_t(q) * 4, 4));
      if (aligned) _mm_sfence();  // the streamed lines are visible before the pool's barrier
      continue;
    }
#endif
    constexpr int64_t kBlock = 64;
    for (int64_t q0 = 0; q0 < pairs; q0 += kBlock) {
      const int64_t q1 = std::min(pairs, q0 + kBlock);
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* src = first + size_t(r * I + 2 * q0) * 2;
        uint8_t* dst = panel + size_t(q0 * 64 + r * 4);
        for (int64_t q = q0; q < q1; ++q, src += 4, dst += 64) std::memcpy(dst, src, 4);
      }
      for (int64_t q = q0; rows < kPanel && q < q1;
           ++q)  // the rows past O: zeros, whatever was there
        std::memset(panel + size_t(q * 64 + rows * 4), 0, size_t(kPanel - rows) * 4);
    }
  }
}

void matmul_rows(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                 int o_end) {
  const int n = int(W.shape[1]);
  if (packable(W.dtype)) {
    if (!W.packed) throw Error("matmul: weight \"" + W.name + "\" was not packed (pack_bf16)");
    if (W.dtype == DType::MXFP4)
      matmul_mxfp4(x, W, y, ldy, o_begin, o_end);
    else if (W.dtype == DType::F8_E4M3 && fp8_native(W))
      matmul_fp8(x, W, y, ldy, o_begin, o_end);
    else
      matmul_packed(x, W, y, ldy, o_begin, o_end);
  } else
    matmul_f32(static_cast<const float*>(W.data), x, n, y, ldy, o_begin, o_end);
}

}  // namespace R3_ISA_NS
}  // namespace r3::kernels

#include "kernels/isa_end.h"
