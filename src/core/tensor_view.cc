#include "core/tensor_view.h"

#include <cstring>

#include "core/panel_layout.h"
#include "core/u64_words.h"

namespace r3 {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float TensorView::at(int64_t i) const {
  if (!data && packed) return packed_element(*this, i / shape[1], i % shape[1]);
  switch (dtype) {
    case DType::F32:
      return static_cast<const float*>(data)[i];
    case DType::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::F16:
      return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::U8:
      return float(static_cast<const uint8_t*>(data)[i]);
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

namespace {
// The high bit of each lane of x that is zero (the classic borrow test), for 16- or 32-bit lanes.
inline uint64_t zero_lanes(uint64_t x, uint64_t ones, uint64_t highs) {
  return (x - ones) & ~x & highs;
}
}  // namespace

// Blocks of 64 words with no branch inside (the compiler vectorises the OR of each block's
// zero-lane test), each flagged block then searched element by element: a refit reads every byte
// anyway, and this keeps the check near the speed of that read (bench/kernels_bench.cc
// BM_NonFiniteScan times it beside BM_PackBf16).
int64_t first_non_finite(const TensorView& t) {
  const auto* b = static_cast<const uint8_t*>(t.data);
  if (!b || !is_float_dtype(t.dtype)) return -1;
  const int64_t n = t.numel();
  const size_t width = dtype_size(t.dtype);
  const uint64_t lane_mask = t.dtype == DType::F32    ? 0x7f800000ull
                             : t.dtype == DType::BF16 ? 0x7f80ull
                                                      : 0x7c00ull;
  const uint64_t mask =
      width == 4 ? lane_mask | lane_mask << 32 : lane_mask * 0x0001000100010001ull;
  const uint64_t ones = width == 4 ? 0x0000000100000001ull : 0x0001000100010001ull;
  const uint64_t highs = width == 4 ? 0x8000000080000000ull : 0x8000800080008000ull;
  auto bad = [&](int64_t i) {
    uint32_t bits = 0;
    std::memcpy(&bits, b + size_t(i) * width, width);
    return (bits & lane_mask) == lane_mask;
  };
  auto search = [&](int64_t from, int64_t to) -> int64_t {
    for (int64_t i = from; i < to; ++i)
      if (bad(i)) return i;
    return -1;
  };
  constexpr int64_t kBlockWords = 64;
  const int64_t per_word = int64_t(8 / width), blocks = n / per_word / kBlockWords;
  for (int64_t k = 0; k < blocks; ++k) {
    const uint8_t* p = b + size_t(k) * kBlockWords * 8;
    uint64_t any = 0;
    for (int64_t w = 0; w < kBlockWords;
         ++w)  // a zero lane of (x & mask) ^ mask: exponent all ones
      any |= zero_lanes((load_u64(p + w * 8) & mask) ^ mask, ones, highs);
    if (any)
      if (const int64_t i = search(k * kBlockWords * per_word, (k + 1) * kBlockWords * per_word);
          i >= 0)
        return i;
  }
  return search(blocks * kBlockWords * per_word, n);
}

}  // namespace r3
