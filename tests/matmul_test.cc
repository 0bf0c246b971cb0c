// The matmul kernels compute exactly the reduction order of kernels/dot.h: the SIMD paths equal
// the portable ones bit for bit (so a machine without the instructions gives the same results),
// and a token's outputs do not depend on the batch around it.
#include "kernels/matmul.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <random>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/dot.h"

namespace r3::kernels {
namespace {

struct Data {
  std::vector<uint16_t> wb;
  PackedBf16 packed;
  std::vector<float> wf, x;
  std::vector<uint16_t> xb;
  TensorView Wb, Wf;
};

Data make(int O, int n, int T, uint64_t seed, bool extreme) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0, 1);
  std::uniform_int_distribution<int> e(-140, 20);
  Data D;
  auto value = [&] { return extreme && rng() % 4 == 0 ? std::ldexp(d(rng), e(rng)) : d(rng); };
  for (int i = 0; i < O * n; ++i) {
    float v = value();
    D.wb.push_back(f32_to_bf16(v));
    D.wf.push_back(v);
  }
  for (int i = 0; i < T * n; ++i) D.x.push_back(value());
  D.xb.resize(D.x.size());
  round_to_bf16(D.x.data(), int64_t(D.x.size()), D.xb.data());
  D.Wb.dtype = DType::BF16;
  D.Wb.shape = {O, n};
  D.Wb.data = D.wb.data();
  D.packed = pack_bf16(D.Wb);
  D.Wb.packed = D.packed.data();
  D.Wf.dtype = DType::F32;
  D.Wf.shape = {O, n};
  D.Wf.data = D.wf.data();
  return D;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(Matmul, EqualsPortableOrderBitForBit) {
  // Token counts reach every tile shape (1 token, 4 panels x up to 6, 2 panels x 8 with a
  // remainder tile); n = 1024 and 1030 split the pairs into chunks (a short last one).
  for (int n : {2, 8, 16, 30, 32, 34, 64, 100, 1024, 1030})
    for (int T : {1, 5, 13, 20})
      for (bool extreme : {false, true}) {
        const int O = 37;  // panel remainders
        Data D = make(O, n, T, uint64_t(n) * 7 + uint64_t(T) * 3 + extreme, extreme);
        std::vector<float> yb(size_t(T) * O), yf(size_t(T) * O);
        matmul_rows({D.x.data(), D.xb.data(), T}, D.Wb, yb.data(), O, 0, O);
        matmul_rows({D.x.data(), D.xb.data(), T}, D.Wf, yf.data(), O, 0, O);
        for (int t = 0; t < T; ++t)
          for (int o = 0; o < O; ++o) {
            const float pb =
                dot_bf16_portable(D.wb.data() + size_t(o) * n, D.xb.data() + size_t(t) * n, n);
            const float pf =
                dot_f32_portable(D.wf.data() + size_t(o) * n, D.x.data() + size_t(t) * n, n);
            ASSERT_EQ(bits(yb[size_t(t) * O + o]), bits(pb))
                << "bf16 n=" << n << " T=" << T << " t=" << t << " o=" << o;
            ASSERT_EQ(bits(yf[size_t(t) * O + o]), bits(pf))
                << "f32 n=" << n << " t=" << t << " o=" << o;
          }
      }
}

// A sum that lands just below FLT_MIN: gradual underflow would round it up to FLT_MIN, but the
// instruction (and x86 FTZ) judges tininess with an unbounded exponent and flushes it to zero.
TEST(Matmul, FlushesTinySumsLikeTheInstruction) {
  const float below = -1.5f * 0x1p-75f, above = -1.25f * 0x1p-75f;  // pair 1's w[1]
  for (float w3 : {below, above}) {
    // pair 0 leaves 2^-126 + 2^-149; pair 1 adds w3 * 2^-74 first.
    const std::vector<float> wf = {0x1p-75f, 0x1p-63f, 0.f, w3},
                             xf = {0x1p-74f, 0x1p-63f, 0.f, 0x1p-74f};
    std::vector<uint16_t> wb, xb;
    for (float v : wf) wb.push_back(f32_to_bf16(v));
    for (float v : xf) xb.push_back(f32_to_bf16(v));
    const float expected = w3 == below ? 0.f : FLT_MIN;
    EXPECT_EQ(bits(dot_bf16_portable(wb.data(), xb.data(), 4)), bits(expected));
    TensorView W;
    W.dtype = DType::BF16;
    W.shape = {1, 4};
    W.data = wb.data();
    const PackedBf16 packed = pack_bf16(W);
    W.packed = packed.data();
    float y = -1;
    matmul_rows({xf.data(), xb.data(), 1}, W, &y, 1, 0, 1);
    EXPECT_EQ(bits(y), bits(expected));
#if defined(__AVX512BF16__)
    __m512 acc = _mm512_setzero_ps();
    for (int q = 0; q < 2; ++q) {
      uint32_t wp, xp;
      std::memcpy(&wp, wb.data() + 2 * q, 4);
      std::memcpy(&xp, xb.data() + 2 * q, 4);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(int(wp)),
                             (__m512bh)_mm512_set1_epi32(int(xp)));
    }
    EXPECT_EQ(bits(_mm512_cvtss_f32(acc)), bits(expected)) << "vdpbf16ps";
#endif
  }
}

// dp_pair against the instruction itself where the CPU has it, on pairs around the denormal range.
TEST(Matmul, PortablePairStepEqualsVdpbf16ps) {
#if !defined(__AVX512BF16__)
  GTEST_SKIP() << "no AVX512-BF16 on this build";
#else
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> exponent(40, 100);  // products and sums near 2^-126
  auto value = [&] {
    const uint16_t e = rng() % 40 == 0 ? 0 : uint16_t(exponent(rng));
    return uint16_t((rng() & 1) << 15 | e << 7 | (rng() & 127));
  };
  for (int i = 0; i < 200000; ++i) {
    uint16_t w[8], x[8];
    for (int k = 0; k < 8; ++k) w[k] = value(), x[k] = value();
    float portable = 0.f;
    __m512 acc = _mm512_setzero_ps();
    for (int q = 0; q < 4; ++q) {
      portable = dp_pair(portable, w + 2 * q, x + 2 * q);
      uint32_t wp, xp;
      std::memcpy(&wp, w + 2 * q, 4);
      std::memcpy(&xp, x + 2 * q, 4);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(int(wp)),
                             (__m512bh)_mm512_set1_epi32(int(xp)));
    }
    ASSERT_EQ(bits(portable), bits(_mm512_cvtss_f32(acc))) << "case " << i;
  }
#endif
}

TEST(Matmul, BatchInvariant) {
  const int O = 37, n = 96, T = 11;
  Data D = make(O, n, T, 3, false);
  std::vector<float> all(size_t(T) * O);
  ThreadPool pool(2);
  matmul({D.x.data(), D.xb.data(), T}, D.Wb, all.data(), &pool);
  for (int start = 0; start < T; ++start)
    for (int len = 1; start + len <= T; ++len) {
      std::vector<float> part(size_t(len) * O);
      matmul_rows({D.x.data() + size_t(start) * n, D.xb.data() + size_t(start) * n, len}, D.Wb,
                  part.data(), O, 0, O);
      for (int t = 0; t < len; ++t)
        for (int o = 0; o < O; ++o)
          ASSERT_EQ(bits(part[size_t(t) * O + o]), bits(all[size_t(start + t) * O + o]));
    }
  // Row ranges computed separately give the same values as the whole.
  std::vector<float> rows(size_t(T) * O);
  for (int o = 0; o < O; o += 5)
    matmul_rows({D.x.data(), D.xb.data(), T}, D.Wb, rows.data(), O, o, std::min(O, o + 5));
  EXPECT_EQ(rows, all);
}

// An expert reads its tokens in place through row_ids (any order, repeats allowed): the same
// bits as a gathered copy, for bf16 and f32 weights and every tile width.
TEST(Matmul, RowIdsEqualAGatheredCopy) {
  const int O = 70, n = 64, T = 12;
  Data D = make(O, n, T, 5, false);
  std::mt19937 rng(9);
  for (int len = 1; len <= 11; ++len) {
    std::vector<int> ids(static_cast<size_t>(len));
    for (int& id : ids) id = int(rng() % T);
    std::vector<float> gx;
    std::vector<uint16_t> gxb;
    for (int id : ids) {
      gx.insert(gx.end(), D.x.begin() + id * n, D.x.begin() + (id + 1) * n);
      gxb.insert(gxb.end(), D.xb.begin() + id * n, D.xb.begin() + (id + 1) * n);
    }
    for (const TensorView* W : {&D.Wb, &D.Wf}) {
      std::vector<float> want(size_t(len) * O), got(size_t(len) * O);
      matmul_rows({gx.data(), gxb.data(), len}, *W, want.data(), O, 0, O);
      matmul_rows({D.x.data(), D.xb.data(), len, ids.data()}, *W, got.data(), O, 0, O);
      ASSERT_EQ(want, got) << "rows " << len;
    }
  }
}

// Several weights as one pool job: each output equals its own matmul (large and small jobs).
TEST(Matmul, ManyEqualsOneAtATime) {
  ThreadPool pool(2);
  for (int T : {1, 9}) {
    Data a = make(100, 64, T, 11, false), b = make(37, 64, T, 12, false),
         c = make(200, 64, T, 13, false);
    b.x = a.x, b.xb = a.xb, c.x = a.x, c.xb = a.xb;
    std::vector<float> ya(size_t(T) * 100), yb(size_t(T) * 37), yc(size_t(T) * 200);
    const MatmulOut outs[] = {{&a.Wb, ya.data()}, {&b.Wf, yb.data()}, {&c.Wb, yc.data()}};
    matmul_many({a.x.data(), a.xb.data(), T}, outs, &pool);
    std::vector<float> wa(ya.size()), wb(yb.size()), wc(yc.size());
    matmul({a.x.data(), a.xb.data(), T}, a.Wb, wa.data(), &pool);
    matmul({a.x.data(), a.xb.data(), T}, b.Wf, wb.data(), &pool);
    matmul({a.x.data(), a.xb.data(), T}, c.Wb, wc.data(), &pool);
    EXPECT_EQ(ya, wa);
    EXPECT_EQ(yb, wb);
    EXPECT_EQ(yc, wc);
  }
}

TEST(Matmul, UnpackedBf16IsAnError) {
  Data D = make(4, 8, 1, 1, false);
  D.Wb.packed = nullptr;
  std::vector<float> y(4);
  EXPECT_THROW(matmul_rows({D.x.data(), D.xb.data(), 1}, D.Wb, y.data(), 4, 0, 4), Error);
  TensorView odd = D.Wb;
  odd.shape = {8, 4};
  EXPECT_NO_THROW(pack_bf16(odd));
  odd.shape = {4, 7};
  EXPECT_THROW(pack_bf16(odd), Error);
}

// A refit repacks a weight's panels in place: packing over stale bytes gives the bytes of a
// pack into fresh zeros, padding rows (O not a multiple of 16), FP8's padding pair row (an odd
// number of pairs) and its scale padding included, whatever the panel range of each call.
TEST(Matmul, RepackOverStaleBytesEqualsAFreshPack) {
  std::mt19937_64 rng(23);
  std::vector<uint8_t> codes(size_t(133) * 1056), scales(size_t(133) * 1056 / 32);
  for (uint8_t& b : codes) b = uint8_t(rng());
  for (uint8_t& b : scales) b = uint8_t(120 + rng() % 14);
  std::vector<uint8_t> fp8(size_t(53) * 1030);
  for (uint8_t& b : fp8) do
      b = uint8_t(rng());
    while (e4m3_is_nan(b));
  std::vector<float> block_scales(size_t(4) * 9, 0.5f);
  std::vector<uint16_t> bf16(size_t(133) * 70);
  for (uint16_t& v : bf16) v = f32_to_bf16(float(int(rng() % 200) - 100));
  std::vector<TensorView> weights;
  for (int n : {32, 1056}) {
    TensorView m{.dtype = DType::MXFP4, .shape = {133, n}, .data = codes.data()};
    m.scales = scales.data();
    weights.push_back(m);
  }
  for (auto [o, n, b] : {std::tuple{53, 1030, 128}, {53, 200, 64}, {40, 36, 4}}) {
    TensorView f{.dtype = DType::F8_E4M3, .shape = {o, n}, .data = fp8.data()};
    f.scale_inv = block_scales.data();
    f.block_rows = b % 16 ? 16 : b;
    f.block_cols = b;
    ASSERT_TRUE(fp8_native(f));
    weights.push_back(f);
  }
  weights.push_back(TensorView{.dtype = DType::BF16, .shape = {133, 70}, .data = bf16.data()});
  for (const TensorView& W : weights) {
    const PackedBf16 fresh = pack_bf16(W);
    PackedBf16 stale(fresh.size(), 0xA5A5);
    const int64_t panels = (W.shape[0] + kPanelRows - 1) / kPanelRows;
    pack_bf16_panels(W, stale.data(), 0, panels / 2);
    pack_bf16_panels(W, stale.data(), panels / 2, panels);
    EXPECT_TRUE(fresh == stale) << dtype_name(W.dtype) << " " << W.shape_str();
  }
}

TEST(Matmul, CloseToExactDot) {
  const int O = 8, n = 512, T = 3;
  Data D = make(O, n, T, 9, false);
  std::vector<float> y(size_t(T) * O);
  matmul_rows({D.x.data(), D.xb.data(), T}, D.Wb, y.data(), O, 0, O);
  for (int t = 0; t < T; ++t)
    for (int o = 0; o < O; ++o) {
      double exact = 0;
      for (int i = 0; i < n; ++i)
        exact += double(bf16_to_f32(D.wb[size_t(o) * n + i])) * D.x[size_t(t) * n + i];
      EXPECT_NEAR(y[size_t(t) * O + o], exact, 1e-4 * std::sqrt(double(n)));
    }
}

}  // namespace
}  // namespace r3::kernels
