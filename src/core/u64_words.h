// Rearranging 16-bit elements four at a time in 64-bit words: portable C++ that every compiler
// keeps in registers, so the weight packers and the checkpoint's transposing copies move eight
// bytes per load and store instead of two, and give the same bytes on every machine.
#pragma once
#include <cstdint>
#include <cstring>

namespace r3 {

inline uint64_t load_u64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline void store_u64(void* p, uint64_t v) { std::memcpy(p, &v, 8); }

// The low and the high 32-bit halves of a and b: (a.lo, b.lo) and (a.hi, b.hi).
inline uint64_t low_halves(uint64_t a, uint64_t b) { return (a & 0xFFFFFFFFull) | b << 32; }
inline uint64_t high_halves(uint64_t a, uint64_t b) {
  return a >> 32 | (b & 0xFFFFFFFF00000000ull);
}

// The 4x4 transpose of 16-bit words: s[i] holds row i's words 0..3 (word j at bits 16j), t[j]
// gets column j (row i's word j at bits 16i).
inline void transpose_u16_4x4(const uint64_t s[4], uint64_t t[4]) {
  constexpr uint64_t kEven = 0x0000FFFF0000FFFFull;
  // a: rows 0 and 1's words 0 and 2 interleaved, b: their words 1 and 3; d, e: rows 2 and 3's.
  const uint64_t a = (s[0] & kEven) | (s[1] & kEven) << 16,
                 b = (s[0] >> 16 & kEven) | (s[1] & ~kEven);
  const uint64_t d = (s[2] & kEven) | (s[3] & kEven) << 16,
                 e = (s[2] >> 16 & kEven) | (s[3] & ~kEven);
  t[0] = low_halves(a, d);
  t[1] = low_halves(b, e);
  t[2] = high_halves(a, d);
  t[3] = high_halves(b, e);
}

// The even (0, 2) and the odd (1, 3) 16-bit words of a then b, four words each: a's two in the
// low half.
inline uint64_t even_u16(uint64_t a, uint64_t b) {
  constexpr uint64_t kEven = 0x0000FFFF0000FFFFull;
  const uint64_t x = a & kEven, y = b & kEven;
  return ((x | x >> 16) & 0xFFFFFFFFull) | ((y | y >> 16) & 0xFFFFFFFFull) << 32;
}
inline uint64_t odd_u16(uint64_t a, uint64_t b) { return even_u16(a >> 16, b >> 16); }

// Transposing copies of 16-bit matrices, a tile at a time: a tile's source lines are copied
// whole into a small buffer (source rows a power of two apart would evict one another from L1),
// then written out as whole destination lines, the next tile's source lines requested meanwhile.
// The same bytes as the element loops that finish the edges past the whole tiles.
constexpr int64_t kTransposeRows = 32;  // source rows per tile: a 64-byte line of each output row

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols.
inline void transpose_u16(const uint16_t* src, int64_t ld_src, int64_t rows, int64_t cols,
                          uint16_t* dst, int64_t ld_dst) {
  constexpr int64_t kR = kTransposeRows, kC = 32;  // a tile: 32 source lines in, 32 lines out
  const int64_t rows_t = rows / kR * kR, cols_t = cols / kC * kC;
  alignas(64) uint16_t tile[kR][kC];
  for (int64_t r0 = 0; r0 < rows_t; r0 += kR)
    for (int64_t c0 = 0; c0 < cols_t; c0 += kC) {
      for (int i = 0; i < kR; ++i) {
        std::memcpy(tile[i], src + (r0 + i) * ld_src + c0, sizeof tile[i]);
        __builtin_prefetch(src + (r0 + i) * ld_src + c0 + 2 * kC);
      }
      for (int c = 0; c < kC; c += 4)
        for (int r = 0; r < kR; r += 4) {
          uint64_t s[4], t[4];
          for (int i = 0; i < 4; ++i) s[i] = load_u64(&tile[r + i][c]);
          transpose_u16_4x4(s, t);
          for (int j = 0; j < 4; ++j) store_u64(dst + (c0 + c + j) * ld_dst + r0 + r, t[j]);
        }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = r < rows_t ? cols_t : 0; c < cols; ++c)
      dst[c * ld_dst + r] = src[r * ld_src + c];
}

// The same for a source whose columns hold interleaved pairs, split while transposed:
// even[c * ld_dst + r] = src[r * ld_src + 2c] and odd[c * ld_dst + r] = src[r * ld_src + 2c + 1],
// for r < rows, c < pairs.
inline void transpose_u16_pairs(const uint16_t* src, int64_t ld_src, int64_t rows, int64_t pairs,
                                uint16_t* even, uint16_t* odd, int64_t ld_dst) {
  constexpr int64_t kR = kTransposeRows, kC = 16;  // a tile: 32 source lines in, 2 x 16 lines out
  const int64_t rows_t = rows / kR * kR, pairs_t = pairs / kC * kC;
  alignas(64) uint16_t tile[kR][2 * kC];
  for (int64_t r0 = 0; r0 < rows_t; r0 += kR)
    for (int64_t c0 = 0; c0 < pairs_t; c0 += kC) {
      for (int i = 0; i < kR; ++i) {
        std::memcpy(tile[i], src + (r0 + i) * ld_src + 2 * c0, sizeof tile[i]);
        __builtin_prefetch(src + (r0 + i) * ld_src + 2 * (c0 + 2 * kC));
      }
      for (int c = 0; c < kC; c += 4)
        for (int r = 0; r < kR; r += 4) {
          uint64_t se[4], so[4], te[4], to[4];
          for (int i = 0; i < 4; ++i) {
            const uint64_t a = load_u64(&tile[r + i][2 * c]), b = load_u64(&tile[r + i][2 * c + 4]);
            se[i] = even_u16(a, b);
            so[i] = odd_u16(a, b);
          }
          transpose_u16_4x4(se, te);
          transpose_u16_4x4(so, to);
          for (int j = 0; j < 4; ++j) {
            store_u64(even + (c0 + c + j) * ld_dst + r0 + r, te[j]);
            store_u64(odd + (c0 + c + j) * ld_dst + r0 + r, to[j]);
          }
        }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = r < rows_t ? pairs_t : 0; c < pairs; ++c) {
      even[c * ld_dst + r] = src[r * ld_src + 2 * c];
      odd[c * ld_dst + r] = src[r * ld_src + 2 * c + 1];
    }
}

}  // namespace r3
