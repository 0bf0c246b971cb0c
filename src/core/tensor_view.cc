#include "core/tensor_view.h"

#include "core/panel_layout.h"

namespace r3 {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float TensorView::at(int64_t i) const {
  if (!data && packed) return packed_element(*this, i / shape[1], i % shape[1]);
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(data)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::U8: return float(static_cast<const uint8_t*>(data)[i]);
    case DType::MXFP4: {
      const uint8_t byte = static_cast<const uint8_t*>(data)[i / 2];
      return mxfp4_value(i % 2 ? byte >> 4 : byte & 15, scales[i / 32]);
    }
    case DType::F8_E4M3: {
      const float v = e4m3_to_f32(static_cast<const uint8_t*>(data)[i]);
      if (!scale_inv) return v;
      const int64_t I = shape[1], o = i / I, k = i % I;
      return v * scale_inv[o / block_rows * ((I + block_cols - 1) / block_cols) + k / block_cols];
    }
  }
  return 0.f;
}

std::vector<float> TensorView::to_f32() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[size_t(i)] = at(i);
  return out;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace r3
