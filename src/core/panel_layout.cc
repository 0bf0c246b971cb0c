#include "core/panel_layout.h"

#include <algorithm>
#include <array>

#include "core/dtype.h"

namespace r3 {

float packed_element(const TensorView& W, int64_t o, int64_t i) {
  const int64_t p = o / kPanelRows;
  const int lane = int(o % kPanelRows);
  const auto* panel =
      reinterpret_cast<const uint8_t*>(W.packed) + size_t(p) * packed_panel_bytes(W);
  if (W.dtype == DType::MXFP4) {
    const uint8_t* group = panel + size_t(i / 32) * kMxfp4GroupBytes;
    const int j = int(i % 32 / 2);
    const uint8_t code =
        uint8_t(group[mxfp4_code_byte(j, lane, int(i % 2))] >> mxfp4_code_shift(j) & 15);
    return mxfp4_value(code, group[kMxfp4GroupPairs * 16 + lane]);
  }
  if (W.dtype == DType::F8_E4M3 && fp8_native(W)) {
    const auto* scales = reinterpret_cast<const float*>(panel + fp8_scales_offset(W));
    return e4m3_to_f32(panel[fp8_code_byte(i / 2, lane, int(i % 2))]) * scales[i / W.block_cols];
  }
  return bf16_to_f32(reinterpret_cast<const uint16_t*>(
      panel)[size_t(i / 2) * 2 * kPanelRows + size_t(lane) * 2 + size_t(i % 2)]);
}

void packed_row(const TensorView& W, int64_t o, float* out) {
  const int64_t I = W.shape[1];
  if (W.dtype == DType::BF16 || (W.dtype == DType::F8_E4M3 && !fp8_native(W))) {
    const uint16_t* panel =
        W.packed + size_t(o / kPanelRows) * packed_panel_bytes(W) / 2 + size_t(o % kPanelRows) * 2;
    for (int64_t q = 0; q < I / 2; ++q) {
      out[2 * q] = bf16_to_f32(panel[size_t(q) * 2 * kPanelRows]);
      out[2 * q + 1] = bf16_to_f32(panel[size_t(q) * 2 * kPanelRows + 1]);
    }
    return;
  }
  // The quantized panels: the same decode as packed_element, with the panel's address and the
  // row's lane worked out once per row rather than per element.
  const int lane = int(o % kPanelRows);
  const auto* panel =
      reinterpret_cast<const uint8_t*>(W.packed) + size_t(o / kPanelRows) * packed_panel_bytes(W);
  if (W.dtype == DType::MXFP4) {
    for (int64_t g = 0; g < I / 32; ++g) {
      const uint8_t* group = panel + size_t(g) * kMxfp4GroupBytes;
      const uint8_t scale = group[kMxfp4GroupPairs * 16 + lane];
      for (int k = 0; k < 32; ++k) {
        const int j = k / 2;
        out[g * 32 + k] = mxfp4_value(
            uint8_t(group[mxfp4_code_byte(j, lane, k % 2)] >> mxfp4_code_shift(j) & 15), scale);
      }
    }
    return;
  }
  const auto* scales = reinterpret_cast<const float*>(panel + fp8_scales_offset(W));
  static const std::array<float, 256> e4m3 = [] {  // every code's value: no branch per element
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[size_t(c)] = e4m3_to_f32(uint8_t(c));
    return v;
  }();
  for (int64_t i0 = 0, b = 0; i0 < I;
       i0 += W.block_cols, ++b) {  // a column block at a time: one scale
    const float scale = scales[b];
    for (int64_t i = i0; i < std::min(I, i0 + W.block_cols); ++i)
      out[i] = e4m3[panel[fp8_code_byte(i / 2, lane, int(i % 2))]] * scale;
  }
}

void packed_fp8_codes(const TensorView& W, uint8_t* codes) {
  const int64_t O = W.shape[0], I = W.shape[1];
  for (int64_t o = 0; o < O; ++o) {
    const auto* panel =
        reinterpret_cast<const uint8_t*>(W.packed) + size_t(o / kPanelRows) * packed_panel_bytes(W);
    for (int64_t i = 0; i < I; ++i)
      codes[o * I + i] = panel[fp8_code_byte(i / 2, int(o % kPanelRows), int(i % 2))];
  }
}

}  // namespace r3
