// Storage dtypes and scalar conversions (bf16 and f16 to and from fp32).
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/u64_words.h"

namespace r3 {

// F32, BF16, F16, U8 and F8_E4M3 are stored (safetensors); MXFP4 exists only as a view of U8
// blocks and scales (core/tensor_view.h): 4-bit e2m1 values, two per byte, low nibble first, each
// block of 32 along a row scaled by 2^(scale - 127) (OCP microscaling, as GPT-OSS is released).
// F8_E4M3 weights come with fp32 block scales (weight_scale_inv, as DeepSeek-V3 is released).
enum class DType { F32, BF16, F16, U8, MXFP4, F8_E4M3 };

// Bytes per element; MXFP4's half byte (and its scales) are counted by TensorView::nbytes.
inline size_t dtype_size(DType t) {
  return t == DType::F32 ? 4 : t == DType::BF16 || t == DType::F16 ? 2 : 1;
}
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::U8:
      return "U8";
    case DType::MXFP4:
      return "MXFP4";
    case DType::F8_E4M3:
      return "F8_E4M3";
  }
  return "?";
}
inline bool is_float_dtype(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

// MXFP4: the e2m1 values of the 16 nibbles, and one element as fp32 (exact: ldexp of a value
// with two significant bits).
inline constexpr float kE2m1Values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                          -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
// A scale of 1..254 is the normal float 2^(scale-127), built from its bits, and the product is
// exact; 0 and 255 (2^-127, 2^128) go through ldexp. Same bits as ldexp everywhere, without a
// libm call per element (the reference forward decodes every weight it reads).
inline float mxfp4_value(uint8_t nibble, uint8_t scale) {
  if (scale == 0 || scale == 255) return std::ldexp(kE2m1Values[nibble & 15], int(scale) - 127);
  const uint32_t bits = uint32_t(scale) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return kE2m1Values[nibble & 15] * f;
}

// FP8 e4m3fn (OCP): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f / 0xff
// are NaN; largest finite 448. Every value is exact in fp32 and in bf16.
// A normal code's value (8 + m) * 2^(e-10) = 1.m * 2^(e-7) is written as float bits.
inline float e4m3_to_f32(uint8_t b) {
  const uint32_t e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 0) {
    v = float(m) * 0x1p-9f;  // subnormal: m * 2^-9, exact
  } else if (e == 15 && m == 7) {
    v = NAN;
  } else {
    const uint32_t bits = (e + 120) << 23 | m << 20;
    std::memcpy(&v, &bits, 4);
  }
  return b & 0x80 ? -v : v;
}
inline bool e4m3_is_nan(uint8_t b) { return (b & 0x7f) == 0x7f; }
// The index of the first NaN code among n e4m3 codes, or -1: eight codes a word, since a refit
// checks every code of every FP8 weight it is sent. (b & 0x7f) + 1 carries into bit 7 exactly
// when the low seven bits are all ones, and never into the next byte.
inline int64_t first_e4m3_nan(const uint8_t* b, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = load_u64(b + i);
    if (((w & 0x7f7f7f7f7f7f7f7full) + 0x0101010101010101ull) & 0x8080808080808080ull) break;
  }
  for (; i < n; ++i)
    if (e4m3_is_nan(b[i])) return i;
  return -1;
}
// Nearest e4m3 value, ties to even, saturating at +-448 (how checkpoints are quantized).
inline uint8_t f32_to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (!(a < 448.f)) return std::isnan(x) ? 0x7f : uint8_t(sign | 0x7e);
  static const auto values = [] {  // codes 0..0x7e increase with their value
    std::array<float, 0x7f> v{};
    for (int b = 0; b < 0x7f; ++b) v[size_t(b)] = e4m3_to_f32(uint8_t(b));
    return v;
  }();
  const int lo =
      int(std::upper_bound(values.begin(), values.end(), a) - values.begin()) - 1;  // last <= a
  if (lo < 0x7e) {
    const float below = a - values[size_t(lo)], above = values[size_t(lo + 1)] - a;
    if (above < below || (above == below && (lo & 1))) return uint8_t(sign | (lo + 1));
  }
  return uint8_t(sign | lo);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A stored fp32 or bf16 value (a KV cache element, a bias) as fp32: bf16 widens exactly.
inline float widen(float v) { return v; }
inline float widen(uint16_t bits) { return bf16_to_f32(bits); }

// Round to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// fp32 -> nearest bf16 value, kept in fp32 (how activations enter matmuls).
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400u));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = int32_t((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffffu;
  if (((u >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00u | (man ? 0x200u : 0));
  if (exp >= 31) return uint16_t(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return uint16_t(sign);
    man |= 0x800000u;
    uint32_t shift = uint32_t(14 - exp);
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = sign | uint32_t(exp) << 10 | man >> 13, rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;
  return uint16_t(half);
}

}  // namespace r3
