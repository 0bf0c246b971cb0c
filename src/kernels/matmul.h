// y[t, o] = sum_i W[o, i] * x[t, i] for a weight W [O, I] stored as bf16 or f32 (HF layout).
// x holds bf16 values (round_to_bf16 makes them and their bf16 bits). Every y[t, o] is one dot in
// the fixed order of dot.h, so a token's result does not depend on how many rows x has or where
// it sits. bf16 weights are first repacked (pack_bf16) into panels of 16 rows whose input pairs
// are interleaved, so one vector load feeds 16 output rows and no horizontal sums are needed;
// f32 weights use tiles of 4 rows x up to 4 tokens. Work is split over output rows.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/big_alloc.h"
#include "core/thread_pool.h"
#include "core/tensor_view.h"

namespace r3::kernels {

// Storage aligned to a cache line: each 64-byte pair row of a packed panel is then one line
// (malloc's 16-byte alignment made every weight load a split load); big arrays also get huge
// pages (core/big_alloc.h).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(big_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { big_free(p, n * sizeof(T)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
};

struct Activations {
  const float* f32 = nullptr;      // [T, n] (values are bf16-representable)
  const uint16_t* bf16 = nullptr;  // [T, n] the same values as bf16 bits
  int rows = 0;
  // Row r of this input is row row_ids[r] of f32/bf16 (null: row r), so an expert reads its
  // tokens where they are instead of from a gathered copy.
  const int* row_ids = nullptr;
  int row(int r) const { return row_ids ? row_ids[r] : r; }
};

// Rows per packed panel: one AVX-512 register of fp32 lanes.
inline constexpr int kPanelRows = 16;

// Weights the engine repacks into panels: bf16, MXFP4 and block-scaled FP8 (the quantized ones
// stay quantized in their panels and are decoded inside the matmul).
inline bool packable(DType t) { return t == DType::BF16 || t == DType::MXFP4 || t == DType::F8_E4M3; }
// An MXFP4 panel is groups of 16 pair rows (the 16 rows' 32-input block) followed by the rows'
// scales of that block (16 bytes): 272 bytes per group, one sequential stream per panel, so the
// scales arrive with their weights. The group's codes are 4 lines of 64 bytes, line m for pair
// rows 4m..4m + 3: 16-bit word 2r + h of a line holds, at bits 4k, the e2m1 code of row r's
// input 2q + h for its pair row q = 4m + k. One 64-byte load then gives four pair rows whose codes
// a 16-bit shift brings to each word's low bits, where a permute reads them (matmul_tiles.cc).
inline constexpr int kMxfp4GroupPairs = 16;
inline constexpr size_t kMxfp4GroupBytes = kMxfp4GroupPairs * 16 + 16;
// Where pair row j's code of row r, input 2q + h (h = 0, 1) lies in its group: this byte, at
// bit mxfp4_code_shift(j).
inline constexpr size_t mxfp4_code_byte(int j, int r, int h) {
  return size_t(j / 4) * 64 + size_t(2 * (2 * r + h) + j % 4 / 2);
}
inline constexpr int mxfp4_code_shift(int j) { return 4 * (j % 2); }
// Bytes of one packed panel of an MXFP4 weight [O, I] (I a multiple of 32): its groups.
inline size_t mxfp4_panel_bytes(const TensorView& W) {
  return size_t(W.shape[1] / (2 * kMxfp4GroupPairs)) * kMxfp4GroupBytes;
}
// A block-scaled FP8 weight runs natively (8-bit panels decoded inside the matmul) when each
// panel's 16 rows share their block scales and every column block starts on an even pair row:
// block rows a multiple of 16, block columns of 4, as every released FP8 checkpoint (128 x 128).
// Other block shapes are packed as the bf16 panel of their decoded values: the same bits, twice
// the bytes.
inline bool fp8_native(const TensorView& W) { return W.block_rows % kPanelRows == 0 && W.block_cols % 4 == 0; }
// A native FP8 panel: the codes of pair rows q and q + 1 (q even) as one 64-byte line, then one
// fp32 scale per column block, padded to a whole line. Byte 16l + 8h + j of the line holds word
// 8l + j of pair row q + h, where word 2r + i of a pair row is row r's code of input 2q + i: a
// byte unpack of the line (vpunpcklbw / vpunpckhbw, which work in 16-byte lanes) then gives both
// pair rows in the word order of the bf16 panel (matmul_tiles.cc).
inline constexpr size_t fp8_code_byte(int64_t q, int r, int i) {
  const int w = 2 * r + i;
  return size_t(q / 2) * 64 + size_t(w / 8) * 16 + size_t(q % 2) * 8 + size_t(w % 8);
}
// Where a native FP8 panel's block scales start: after its code lines.
inline size_t fp8_scales_offset(const TensorView& W) { return size_t((W.shape[1] / 2 + 1) / 2) * 64; }
inline size_t fp8_panel_bytes(const TensorView& W) {
  const size_t col_blocks = size_t((W.shape[1] + W.block_cols - 1) / W.block_cols);
  return fp8_scales_offset(W) + (col_blocks * 4 + 63) / 64 * 64;
}

// Bytes of one packed panel of a packable weight: bf16 (64 bytes per input pair, as FP8 of other
// block shapes), MXFP4 or native FP8.
inline size_t packed_panel_bytes(const TensorView& W) {
  if (W.dtype == DType::MXFP4) return mxfp4_panel_bytes(W);
  if (W.dtype == DType::F8_E4M3 && fp8_native(W)) return fp8_panel_bytes(W);
  return size_t(W.shape[1] / 2) * 64;
}

// The engine layout of a bf16 weight [O, I] (I even): panels of 16 rows (zero-padded), each
// [I/2 pairs][16 rows][2]. Point TensorView::packed at the result.
using PackedBf16 = std::vector<uint16_t, CacheLineAllocator<uint16_t>>;
PackedBf16 pack_bf16(const TensorView& W);
// Elements of W's packed form (panels x pairs x 16 x 2).
size_t packed_bf16_size(const TensorView& W);
// Panels [panel_begin, panel_end) of W into `packed` (packed_bf16_size elements), in place: a
// refit rewrites the engine's panels without allocating. Every byte of those panels is written,
// the last panel's rows past W's last as zeros, so `packed` needs no clearing first.
void pack_bf16_panels(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end);

// Rows [o_begin, o_end) of W for every activation row (bf16 W must be packed).
void matmul_rows(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin, int o_end);
// Puts the first lines of a range's first pass of panels (what matmul_rows reads first) in
// flight towards L2: a caller that knows its next range issues this before the current one, so
// the next starts on L2 hits instead of memory misses. Weights that are not packed: nothing.
void prefetch_rows_start(const TensorView& W, int o_begin, int o_end);
// All rows, split across the pool.
void matmul(const Activations& x, const TensorView& W, float* y, ThreadPool* pool);
// Several weights applied to the same input (y_i = x W_i^T, ld = W_i's rows) as one job on the
// pool: no barrier between them (e.g. q, k and v).
struct MatmulOut {
  const TensorView* w;
  float* y;
};
void matmul_many(const Activations& x, std::span<const MatmulOut> outs, ThreadPool* pool);
// In place: each value replaced by the nearest bf16 value; its bits go to bits (may be null).
void round_to_bf16(float* x, int64_t n, uint16_t* bits);

}  // namespace r3::kernels
