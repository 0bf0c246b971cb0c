// Where each element of a weight lies in the engine's packed panels (the layouts the matmul
// kernels read, kernels/matmul.h): pure layout facts, so that anything holding a packed weight
// (TensorView::at, the reference forward, a refit) can read its values back without the kernels.
// The packed panels are the only resident copy of a checkpoint's matrices (model/checkpoint.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/tensor_view.h"

namespace r3 {

// Rows per packed panel: one AVX-512 register of fp32 lanes.
inline constexpr int kPanelRows = 16;

// Weights the engine repacks into panels: bf16, MXFP4 and block-scaled FP8 (the quantized ones
// stay quantized in their panels and are decoded inside the matmul).
inline bool packable(DType t) {
  return t == DType::BF16 || t == DType::MXFP4 || t == DType::F8_E4M3;
}
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
inline bool fp8_native(const TensorView& W) {
  return W.block_rows % kPanelRows == 0 && W.block_cols % 4 == 0;
}
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
inline size_t fp8_scales_offset(const TensorView& W) {
  return size_t((W.shape[1] / 2 + 1) / 2) * 64;
}
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

// Element (o, i) of a weight W [O, I] from its packed panels (W.packed), as the kernels decode
// it: bf16 as stored; MXFP4 and native FP8 from the codes and scales their panels hold; FP8 of
// other block shapes as the bf16 value its panel holds.
float packed_element(const TensorView& W, int64_t o, int64_t i);
// Row o of W's packed panels as fp32 ([I] values into out).
void packed_row(const TensorView& W, int64_t o, float* out);
// The e4m3 codes [O, I] of a native FP8 weight, read back from its panels (a refit that sends new
// block scales for codes it does not send).
void packed_fp8_codes(const TensorView& W, uint8_t* codes);

}  // namespace r3
