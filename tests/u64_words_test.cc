// The transposing copies of core/u64_words.h against element loops: every shape class (whole
// tiles only, edges in either dimension or both, fewer than one tile), a source row stride
// wider than the rows read, and a destination stride wider than the rows written, whose bytes
// past each row must stay as they were.
#include "core/u64_words.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/rng.h"

namespace r3 {
namespace {

std::vector<uint16_t> random_words(size_t n, uint64_t seed) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint16_t(hash_pair(seed, i));
  return v;
}

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{32, 32}, {64, 96}, {33, 32}, {32, 35},  {70, 45},
                         {5, 3},   {1, 64},  {96, 1},  {128, 130}};

TEST(U64Words, TransposeEqualsTheElementLoop) {
  uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.rows << "x" << s.cols);
    const int64_t ld_src = s.cols + 7, ld_dst = s.rows + 3;
    const std::vector<uint16_t> src = random_words(size_t(s.rows * ld_src), seed++);
    std::vector<uint16_t> got = random_words(size_t(s.cols * ld_dst), seed++), want = got;
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t c = 0; c < s.cols; ++c)
        want[size_t(c * ld_dst + r)] = src[size_t(r * ld_src + c)];
    transpose_u16(src.data(), ld_src, s.rows, s.cols, got.data(), ld_dst);
    EXPECT_EQ(got, want);
  }
}

TEST(U64Words, PairTransposeSplitsEvenAndOddColumns) {
  uint64_t seed = 100;
  for (const Shape& s : kShapes) {
    const int64_t pairs = s.cols;
    SCOPED_TRACE(testing::Message() << s.rows << "x" << pairs << " pairs");
    const int64_t ld_src = 2 * pairs + 6, ld_dst = s.rows + 5;
    const std::vector<uint16_t> src = random_words(size_t(s.rows * ld_src), seed++);
    std::vector<uint16_t> even = random_words(size_t(pairs * ld_dst), seed++), odd = even;
    std::vector<uint16_t> want_even = even, want_odd = odd;
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t c = 0; c < pairs; ++c) {
        want_even[size_t(c * ld_dst + r)] = src[size_t(r * ld_src + 2 * c)];
        want_odd[size_t(c * ld_dst + r)] = src[size_t(r * ld_src + 2 * c + 1)];
      }
    transpose_u16_pairs(src.data(), ld_src, s.rows, pairs, even.data(), odd.data(), ld_dst);
    EXPECT_EQ(even, want_even);
    EXPECT_EQ(odd, want_odd);
  }
}

TEST(U64Words, FourByFourTransposeMovesEachWord) {
  const uint64_t s[4] = {0x0003000200010000ull, 0x0013001200110010ull, 0x0023002200210020ull,
                         0x0033003200310030ull};
  uint64_t t[4];
  transpose_u16_4x4(s, t);  // word j of row i is 0x00ij
  EXPECT_EQ(t[0], 0x0030002000100000ull);
  EXPECT_EQ(t[1], 0x0031002100110001ull);
  EXPECT_EQ(t[2], 0x0032002200120002ull);
  EXPECT_EQ(t[3], 0x0033002300130003ull);
  EXPECT_EQ(even_u16(0x0003000200010000ull, 0x0007000600050004ull), 0x0006000400020000ull);
  EXPECT_EQ(odd_u16(0x0003000200010000ull, 0x0007000600050004ull), 0x0007000500030001ull);
}

}  // namespace
}  // namespace r3
