// first_non_finite (core/tensor_view.h), the check every refit makes of the float tensors it is
// sent: against an element-by-element reading, over seeded random lengths, dtypes and positions
// (block edges and tails included), and every NaN/infinity bit pattern class.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/tensor_view.h"

namespace r3 {
namespace {

int64_t naive_first_non_finite(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t width = dtype_size(dtype);
  for (size_t i = 0; i < bytes.size() / width; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, bytes.data() + i * width, width);
    const float v = dtype == DType::F32 ? [&] { float f; std::memcpy(&f, &bits, 4); return f; }()
                    : dtype == DType::BF16 ? bf16_to_f32(uint16_t(bits))
                                           : f16_to_f32(uint16_t(bits));
    if (!std::isfinite(v)) return int64_t(i);
  }
  return -1;
}

TEST(TensorView, FirstNonFiniteMatchesReadingEachElement) {
  std::mt19937_64 rng(2026);
  for (int trial = 0; trial < 600; ++trial) {
    const DType dtype = std::vector<DType>{DType::F32, DType::BF16, DType::F16}[trial % 3];
    const size_t width = dtype_size(dtype);
    // Lengths around the 64-word block (512 bytes) and its multiples, and odd tails.
    const int64_t n = std::uniform_int_distribution<int64_t>(1, 3000)(rng);
    std::vector<uint8_t> bytes(size_t(n) * width);
    for (auto& b : bytes) b = uint8_t(rng());
    // Random bytes hold non-finite values now and then; clear every exponent's top bit, then
    // plant 0-3 specials (NaN with random payload, +inf, -inf) at random places.
    for (int64_t i = 0; i < n; ++i) bytes[size_t(i) * width + width - 1] &= 0xbf;
    const int planted = std::uniform_int_distribution<int>(0, 3)(rng);
    for (int k = 0; k < planted; ++k) {
      const int64_t at = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
      const uint32_t exp = dtype == DType::F32    ? 0x7f800000u
                           : dtype == DType::BF16 ? 0x7f80u
                                                  : 0x7c00u;
      uint32_t bits = exp | (rng() % 2 ? (1u << (width * 8 - 1)) : 0u);
      const uint32_t mantissa = (exp & (~exp + 1)) - 1;  // the bits below the exponent's lowest
      if (rng() % 2) bits |= 1u + uint32_t(rng()) % mantissa;  // a NaN (else an infinity)
      std::memcpy(bytes.data() + size_t(at) * width, &bits, width);
    }
    TensorView t;
    t.dtype = dtype;
    t.shape = {n};
    t.data = bytes.data();
    ASSERT_EQ(first_non_finite(t), naive_first_non_finite(bytes, dtype))
        << "trial " << trial << " n " << n;
  }
}

TEST(TensorView, FirstNonFiniteIgnoresOtherDtypesAndViewsWithoutBytes) {
  std::vector<uint8_t> bytes(64, 0xff);
  TensorView t;
  t.dtype = DType::U8;
  t.shape = {64};
  t.data = bytes.data();
  EXPECT_EQ(first_non_finite(t), -1);
  t.dtype = DType::BF16;
  t.shape = {32};
  EXPECT_EQ(first_non_finite(t), 0);
  t.data = nullptr;
  EXPECT_EQ(first_non_finite(t), -1);
}

}  // namespace
}  // namespace r3
