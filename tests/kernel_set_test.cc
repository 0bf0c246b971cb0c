// Every kernel set this CPU can run (kernel_set.h) computes the same bits as the portable set, on
// random inputs that reach every tile shape and the tiny values the flush-to-zero rule governs;
// R3_KERNELS chooses the set and is refused when it names one the CPU lacks. The rest of the
// suite runs on whichever set is active, and `make variants` runs it again under each set.
#include "kernels/kernel_set.h"
#include "kernels/tile_choice.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace r3::kernels {
namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

uint64_t bits(double f) {
  uint64_t u;
  std::memcpy(&u, &f, 8);
  return u;
}

// Normal values, with one in four scaled far down (denormal products and sums) when `extreme`.
std::vector<float> random_values(size_t n, std::mt19937_64& rng, bool extreme) {
  std::normal_distribution<float> d(0, 1);
  std::uniform_int_distribution<int> e(-140, 20);
  std::vector<float> v(n);
  for (float& x : v) x = extreme && rng() % 4 == 0 ? std::ldexp(d(rng), e(rng)) : d(rng);
  return v;
}

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(bits(got[i]), bits(want[i])) << what << " element " << i;
}

TEST(KernelSet, PortableIsAlwaysSupportedAndLast) {
  const auto sets = supported_kernel_sets();
  ASSERT_FALSE(sets.empty());
  EXPECT_STREQ(sets.back()->name, "portable");
  EXPECT_EQ(&choose_kernel_set(nullptr), sets.front());
  EXPECT_EQ(&choose_kernel_set(""), sets.front());
}

TEST(KernelSet, R3KernelsNamesTheActiveSet) {
  const char* forced = std::getenv("R3_KERNELS");
  if (forced && *forced)
    EXPECT_STREQ(active_kernels().name, forced);
  else
    EXPECT_EQ(&active_kernels(), supported_kernel_sets().front());
}

TEST(KernelSet, UnknownOrUnsupportedSetIsRefused) {
  try {
    choose_kernel_set("sse9");
    FAIL() << "unknown set accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown kernel set"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("avx512bf16, avx512, avx2, portable"), std::string::npos)
        << e.what();
  }
  for (const char* name : {"portable", "avx2", "avx512", "avx512bf16"}) {
    bool supported = false;
    for (const KernelSet* s : supported_kernel_sets()) supported |= std::string(s->name) == name;
    if (supported)
      EXPECT_STREQ(choose_kernel_set(name).name, name);
    else
      EXPECT_THROW(choose_kernel_set(name), Error) << name;
  }
}

// Every set's matmul of the quantized weight Wq (rows split mid-panel) against the portable bf16
// matmul of its values as TensorView::at decodes them, rounded to bf16.
void expect_bf16_matmul_of_decoded_values(TensorView Wq, int T, std::mt19937_64& rng,
                                          const std::string& what) {
  const int O = int(Wq.shape[0]), n = int(Wq.shape[1]);
  std::vector<uint16_t> wb(size_t(O) * n);
  for (size_t i = 0; i < wb.size(); ++i) wb[i] = f32_to_bf16(Wq.at(int64_t(i)));
  TensorView Wb{.dtype = DType::BF16, .shape = {O, n}, .data = wb.data()};
  PackedBf16 pb = pack_bf16(Wb), pq = pack_bf16(Wq);
  Wb.packed = pb.data();
  Wq.packed = pq.data();
  std::vector<float> x = random_values(size_t(T) * n, rng, false);
  std::vector<uint16_t> xb(x.size());
  round_to_bf16(x.data(), int64_t(x.size()), xb.data());
  std::vector<float> want(size_t(T) * O);
  kernel_set_portable().matmul_rows({x.data(), xb.data(), T}, Wb, want.data(), O, 0, O);
  const Bf16Tiles before = bf16_tiles();
  for (Bf16Tiles t : {Bf16Tiles::Fma, Bf16Tiles::DotProduct}) {
    set_bf16_tiles(t);
    for (const KernelSet* set : supported_kernel_sets()) {
      std::vector<float> got(size_t(T) * O);
      set->matmul_rows({x.data(), xb.data(), T}, Wq, got.data(), O, 0, 21);
      set->matmul_rows({x.data(), xb.data(), T}, Wq, got.data(), O, 21, O);
      expect_same_bits(got, want,
                       std::string(set->name) + " " + bf16_tiles_name(t) + " " + what +
                           " n=" + std::to_string(n) + " T=" + std::to_string(T));
    }
  }
  set_bf16_tiles(before);
}

// MXFP4 weights, decoded inside the matmul on every set, give the bits of the bf16 matmul of
// the same values (decoded here independently, through TensorView::at), scales at the edges of
// the accepted range included.
TEST(KernelSet, Mxfp4MatmulIsTheBf16MatmulOfItsValues) {
  std::mt19937_64 rng(11);
  for (int n : {32, 64, 1056})
    // Fused decode tiles of 4 panels up to 3 tokens, of 2 panels x up to 8 tokens up to 16 (9,
    // 12 and 13 split in two tiles of about equal width), decoded panels above.
    for (int T : {1, 2, 3, 4, 6, 7, 8, 9, 12, 13, 16, 17}) {
      const int O = 133;  // ranges of more than one 4-panel pass
      std::vector<uint8_t> blocks(size_t(O) * n / 2), scales(size_t(O) * n / 32);
      for (uint8_t& b : blocks) b = uint8_t(rng());
      for (size_t i = 0; i < scales.size(); ++i)
        scales[i] = i % 7 == 0 ? (i % 2 ? 2 : 252) : uint8_t(120 + rng() % 14);
      TensorView Wq{.dtype = DType::MXFP4, .shape = {O, n}, .data = blocks.data()};
      Wq.scales = scales.data();
      for (int64_t i = 0; i < Wq.numel(); ++i)  // exact in bf16
        ASSERT_EQ(round_bf16(Wq.at(i)), Wq.at(i));
      expect_bf16_matmul_of_decoded_values(Wq, T, rng, "mxfp4");
    }
}

// Block-scaled FP8 weights, decoded inside the matmul on every set, give the bits of the bf16
// matmul of their values rounded once to bf16 (decoded here through TensorView::at): blocks
// that end mid-panel and mid-row, zero scales, the smallest accepted scale and a large one, and
// every e4m3 code but NaN.
TEST(KernelSet, Fp8MatmulIsTheBf16MatmulOfItsDecodedValues) {
  std::mt19937_64 rng(13);
  for (auto [n, br, bc] : {std::tuple{32, 5, 6}, {64, 16, 64}, {1030, 128, 128}, {200, 7, 2}})
    for (int T : {1, 2, 3, 4, 6, 8, 9, 13, 16, 17}) {  // the tile shapes of the MXFP4 test
      const int O = 53;
      std::vector<uint8_t> values(size_t(O) * n);
      for (uint8_t& b : values) do
          b = uint8_t(rng());
        while (e4m3_is_nan(b));
      std::vector<float> scales(size_t((O + br - 1) / br) * size_t((n + bc - 1) / bc));
      for (size_t i = 0; i < scales.size(); ++i)
        scales[i] = i % 11 == 3 ? 0.f
                    : i % 5 == 1
                        ? std::ldexp(1.f + 0x3p-8f, -int(i % 4))  // ties to an odd bf16: rounded up
                    : i % 7 == 0 ? (i % 2 ? 0x1p-117f : 0x1p100f)
                                 : std::ldexp(1.f + float(rng() % 1000) / 999.f, -int(rng() % 12));
      TensorView Wq{.dtype = DType::F8_E4M3, .shape = {O, n}, .data = values.data()};
      Wq.scale_inv = scales.data();
      Wq.block_rows = br;
      Wq.block_cols = bc;
      expect_bf16_matmul_of_decoded_values(Wq, T, rng, "fp8");
    }
}

// Both bf16 tile choices (tile_choice.h) give the portable bits for every token count, bf16 and
// the quantized weights decoded into bf16 panels alike.
TEST(KernelSet, MatmulSameBitsWithEitherBf16Tiles) {
  const KernelSet& portable = kernel_set_portable();
  std::mt19937_64 rng(17);
  const Bf16Tiles before = bf16_tiles();
  for (int n : {30, 1030})
    for (int T : {2, 6, 7, 9, 13, 17, 40}) {
      const int O = 53;
      const std::vector<float> wf = random_values(size_t(O) * n, rng, false);
      std::vector<uint16_t> wb(wf.size());
      for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
      TensorView W{.dtype = DType::BF16, .shape = {O, n}, .data = wb.data()};
      std::vector<uint8_t> codes(size_t(O) * n);
      for (uint8_t& b : codes) do
          b = uint8_t(rng());
        while (e4m3_is_nan(b));
      std::vector<float> scales(size_t((O + 15) / 16) * size_t((n + 31) / 32), 0x1p-6f);
      TensorView Q{.dtype = DType::F8_E4M3, .shape = {O, n}, .data = codes.data()};
      Q.scale_inv = scales.data();
      Q.block_rows = 16;
      Q.block_cols = 32;
      std::vector<uint16_t> qb(codes.size());
      for (size_t i = 0; i < qb.size(); ++i) qb[i] = f32_to_bf16(Q.at(int64_t(i)));
      TensorView Qb{.dtype = DType::BF16, .shape = {O, n}, .data = qb.data()};
      PackedBf16 pw = pack_bf16(W), pq = pack_bf16(Q), pqb = pack_bf16(Qb);
      W.packed = pw.data();
      Q.packed = pq.data();
      Qb.packed = pqb.data();
      std::vector<float> x = random_values(size_t(T) * n, rng, false);
      std::vector<uint16_t> xb(x.size());
      round_to_bf16(x.data(), int64_t(x.size()), xb.data());
      std::vector<float> want(size_t(T) * O), want_q(size_t(T) * O);
      portable.matmul_rows({x.data(), xb.data(), T}, W, want.data(), O, 0, O);
      portable.matmul_rows({x.data(), xb.data(), T}, Qb, want_q.data(), O, 0, O);
      for (Bf16Tiles t : {Bf16Tiles::Fma, Bf16Tiles::DotProduct}) {
        set_bf16_tiles(t);
        for (const KernelSet* set : supported_kernel_sets()) {
          std::vector<float> got(size_t(T) * O), got_q(size_t(T) * O);
          set->matmul_rows({x.data(), xb.data(), T}, W, got.data(), O, 0, O);
          set->matmul_rows({x.data(), xb.data(), T}, Q, got_q.data(), O, 0, O);
          const std::string what = std::string(set->name) + " " + bf16_tiles_name(t) +
                                   " n=" + std::to_string(n) + " T=" + std::to_string(T);
          expect_same_bits(got, want, what);
          expect_same_bits(got_q, want_q, what + " fp8");
        }
      }
    }
  set_bf16_tiles(before);
}

// R3_TILES decides when set; otherwise the cache for this CPU model, else a timing that is then
// cached; a damaged cache is timed again; an unknown R3_TILES value is refused.
TEST(KernelSet, Bf16TileChoiceIsTimedOnceAndCached) {
  const Bf16Tiles before = bf16_tiles();
  const std::string dir = ::testing::TempDir() + "/r3_tiles_" + std::to_string(getpid());
  const std::string cache = dir + "/r3/tiles.json";
  std::filesystem::remove_all(dir);
  EXPECT_EQ(choose_bf16_tiles(cache, "dp").tiles, Bf16Tiles::DotProduct);
  EXPECT_EQ(bf16_tiles(), Bf16Tiles::DotProduct);
  EXPECT_EQ(choose_bf16_tiles(cache, "fma").source, "R3_TILES");
  EXPECT_THROW(choose_bf16_tiles(cache, "fast"), Error);
  const TileChoice first = choose_bf16_tiles(cache, nullptr);
  if (std::string(active_kernels().name) != "avx512bf16") {
    EXPECT_EQ(first.tiles, Bf16Tiles::Fma);
    EXPECT_EQ(first.source, "no AVX512-BF16 kernels");
  } else {
    EXPECT_EQ(first.source.rfind("timed on ", 0), 0u) << first.source;
    EXPECT_GT(first.fma_gflops, 0);
    EXPECT_GT(first.dp_gflops, 0);
    EXPECT_EQ(first.tiles,
              first.dp_gflops > first.fma_gflops ? Bf16Tiles::DotProduct : Bf16Tiles::Fma);
    const TileChoice again = choose_bf16_tiles(cache, nullptr);
    EXPECT_EQ(again.source.rfind("cached for ", 0), 0u) << again.source;
    EXPECT_EQ(again.tiles, first.tiles);
    std::ofstream(cache) << "{not json";
    EXPECT_EQ(choose_bf16_tiles(cache, nullptr).source.rfind("timed on ", 0), 0u);
  }
  std::filesystem::remove_all(dir);
  set_bf16_tiles(before);
}

TEST(KernelSet, MatmulSameBitsOnEverySet) {
  const KernelSet& portable = kernel_set_portable();
  std::mt19937_64 rng(7);
  for (int n : {2, 30, 64, 1030})
    for (int T : {1, 2, 6, 7, 9, 13, 17})
      for (bool extreme : {false, true}) {
        const int O =
            133;  // ranges of more than one 4-panel pass (the prefetch runs on into the next)
        const std::vector<float> wf = random_values(size_t(O) * n, rng, extreme);
        std::vector<float> x = random_values(size_t(T) * n, rng, extreme);
        std::vector<uint16_t> wb(wf.size()), xb(x.size());
        for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
        round_to_bf16(x.data(), int64_t(x.size()), xb.data());
        TensorView Wb{.dtype = DType::BF16, .shape = {O, n}, .data = wb.data()};
        const int64_t panels = (O + kPanelRows - 1) / kPanelRows;
        PackedBf16 packed(packed_bf16_size(Wb), 0);
        portable.pack_panels(Wb, packed.data(), 0, panels);
        for (const KernelSet* set : supported_kernel_sets()) {
          PackedBf16 p(packed.size() + 16, 0);
          set->pack_panels(Wb, p.data(), 0, panels);  // 64-byte aligned lines
          ASSERT_TRUE(std::equal(packed.begin(), packed.end(), p.begin()))
              << set->name << " packs differently, n=" << n;
          std::fill(p.begin(), p.end(), 0);
          set->pack_panels(Wb, p.data() + 16, 0, panels);  // lines straddling cache lines
          ASSERT_TRUE(std::equal(packed.begin(), packed.end(), p.begin() + 16))
              << set->name << " unaligned, n=" << n;
        }
        Wb.packed = packed.data();
        const TensorView Wf{.dtype = DType::F32, .shape = {O, n}, .data = wf.data()};
        for (const TensorView* W : {static_cast<const TensorView*>(&Wb), &Wf}) {
          std::vector<float> want(size_t(T) * O);
          portable.matmul_rows({x.data(), xb.data(), T}, *W, want.data(), O, 0, O);
          for (const KernelSet* set : supported_kernel_sets()) {
            std::vector<float> got(size_t(T) * O);
            // Rows in two ranges, the second starting mid-panel.
            set->matmul_rows({x.data(), xb.data(), T}, *W, got.data(), O, 0, 21);
            set->matmul_rows({x.data(), xb.data(), T}, *W, got.data(), O, 21, O);
            expect_same_bits(got, want,
                             std::string(set->name) + (W == &Wb ? " bf16" : " f32") +
                                 " n=" + std::to_string(n) + " T=" + std::to_string(T));
          }
        }
      }
}

// A paged cache of `positions` keys over shuffled blocks, one layer, two kv heads.
template <typename KvT>
struct Cache {
  int bs, hd, kv_dim;
  std::vector<KvT> k, v;
  std::vector<int> table;
  Cache(int positions, int block_size, int head_dim, std::mt19937_64& rng)
      : bs(block_size), hd(head_dim), kv_dim(2 * head_dim) {
    const int blocks = (positions + bs - 1) / bs + 2;
    for (int b = 0; b < blocks; ++b) table.push_back(b);
    std::shuffle(table.begin(), table.end(), rng);
    for (float f : random_values(size_t(blocks) * bs * kv_dim, rng, false)) k.push_back(to_kv(f));
    for (float f : random_values(size_t(blocks) * bs * kv_dim, rng, false)) v.push_back(to_kv(f));
  }
  static KvT to_kv(float f) {
    if constexpr (std::is_same_v<KvT, float>)
      return f;
    else
      return f32_to_bf16(f);
  }
  PagedHead<KvT> head(int h) const {
    return {k.data(), v.data(), table.data(), bs, kv_dim, int64_t(h) * hd};
  }
};

template <typename KvT>
void attention_same_bits(std::mt19937_64& rng) {
  const KernelSet& portable = kernel_set_portable();
  for (int hd : {16, 64, 128})
    for (int bs : {16, 32, 8}) {
      const int positions = 97;
      const Cache<KvT> cache(positions, bs, hd, rng);
      const int stride = (positions + bs - 1) / bs * bs;
      const int pos[4] = {96, 3, 50, 17};
      std::vector<std::vector<float>> q(4);
      for (auto& qi : q) qi = random_values(size_t(hd), rng, false);
      const float* qp[4] = {q[0].data(), q[1].data(), q[2].data(), q[3].data()};
      auto run = [&](const KernelSet& set, int nq) {
        std::vector<float> scores(size_t(4) * stride), out(size_t(4) * hd);
        float* op[4] = {out.data(), out.data() + hd, out.data() + 2 * hd, out.data() + 3 * hd};
        if constexpr (std::is_same_v<KvT, float>) {
          if (nq == 1)
            set.attend_f32(qp[0], hd, pos[0], 0.125f, cache.head(1), scores.data(), out.data());
          else
            set.attend_group_f32(qp, pos, nq, hd, 0.125f, cache.head(1), scores.data(), stride, op);
        } else {
          if (nq == 1)
            set.attend_bf16(qp[0], hd, pos[0], 0.125f, cache.head(1), scores.data(), out.data());
          else
            set.attend_group_bf16(qp, pos, nq, hd, 0.125f, cache.head(1), scores.data(), stride,
                                  op);
        }
        out.resize(size_t(nq) * hd);
        return out;
      };
      for (int nq : {1, 3, 4}) {
        const std::vector<float> want = run(portable, nq);
        for (const KernelSet* set : supported_kernel_sets())
          expect_same_bits(run(*set, nq), want,
                           std::string(set->name) + " hd=" + std::to_string(hd) +
                               " bs=" + std::to_string(bs) + " nq=" + std::to_string(nq));
      }
    }
}

TEST(KernelSet, AttentionSameBitsOnEverySet) {
  std::mt19937_64 rng(11);
  attention_same_bits<float>(rng);
  attention_same_bits<uint16_t>(rng);
}

TEST(KernelSet, PerTokenOpsSameBitsOnEverySet) {
  const KernelSet& portable = kernel_set_portable();
  std::mt19937_64 rng(13);
  for (int n : {1, 15, 16, 33, 2048}) {
    std::vector<float> x = random_values(size_t(n), rng, false),
                       up = random_values(size_t(n), rng, false);
    for (float& v : x) v *= 9.f;  // gates and logits far into exp's range
    const std::vector<float> w = random_values(size_t(n), rng, false);
    const TensorView W{.dtype = DType::F32, .shape = {n}, .data = w.data()};
    auto ops = [&](const KernelSet& set) {
      std::vector<float> norm(static_cast<size_t>(n)), gated(static_cast<size_t>(n)),
          soft(static_cast<size_t>(n));
      std::vector<float> centred(static_cast<size_t>(n));  // a zero-centred norm: (1 + w)
      set.rms_norm(x.data(), W, 0, n, 1e-6f, norm.data(), 0.f);
      set.rms_norm(x.data(), W, 0, n, 1e-6f, centred.data(), 1.f);
      set.silu_mul(x.data(), up.data(), gated.data(), n);
      set.softmax(x.data(), n, soft.data());
      // GPT-OSS's activation at its limit 7 (the wide gates clamped from above), and at limit 1,
      // where both sides of the wide up values are clamped too.
      std::vector<float> clamped(static_cast<size_t>(n)), clamped_up(static_cast<size_t>(n));
      set.clamped_swiglu(x.data(), up.data(), clamped.data(), n, 7.f, 1.702f);
      set.clamped_swiglu(up.data(), x.data(), clamped_up.data(), n, 1.f, 1.702f);
      for (const auto* v : {&centred, &gated, &soft, &clamped, &clamped_up})
        norm.insert(norm.end(), v->begin(), v->end());
      return norm;
    };
    const std::vector<float> want = ops(portable);
    for (const KernelSet* set : supported_kernel_sets()) {
      expect_same_bits(ops(*set), want, std::string(set->name) + " n=" + std::to_string(n));
      EXPECT_EQ(bits(set->sum_f64(x.data(), n)), bits(portable.sum_f64(x.data(), n))) << set->name;
    }
  }
}

// Every set adds a bias as one fp32 add of its stored value, fp32 or bf16 widened, from an
// offset into the bias, over lengths with and without a vector tail.
TEST(KernelSet, AddBiasIsOneAddOfTheStoredValueOnEverySet) {
  std::mt19937_64 rng(19);
  const int size = 1100;
  const std::vector<float> bias_f32 = random_values(size_t(size), rng, true);
  std::vector<uint16_t> bias_bf16(bias_f32.size());
  for (size_t i = 0; i < bias_bf16.size(); ++i) bias_bf16[i] = f32_to_bf16(bias_f32[i]);
  const TensorView f32_view{.dtype = DType::F32, .shape = {size}, .data = bias_f32.data()};
  const TensorView bf16_view{.dtype = DType::BF16, .shape = {size}, .data = bias_bf16.data()};
  for (int n : {1, 15, 16, 33, 1030})
    for (int64_t offset : {0, 7, 70}) {
      const std::vector<float> x = random_values(size_t(n), rng, false);
      for (const KernelSet* set : supported_kernel_sets()) {
        std::vector<float> a = x, b = x;
        set->add_bias(a.data(), f32_view, offset, n);
        set->add_bias(b.data(), bf16_view, offset, n);
        for (int i = 0; i < n; ++i) {
          const size_t at = size_t(offset + i);
          ASSERT_EQ(bits(a[size_t(i)]), bits(x[size_t(i)] + bias_f32[at]))
              << set->name << " n=" << n << " i=" << i;
          ASSERT_EQ(bits(b[size_t(i)]), bits(x[size_t(i)] + bf16_to_f32(bias_bf16[at])))
              << set->name << " n=" << n << " i=" << i;
        }
      }
    }
}

// Every set rounds as core/dtype.h's f32_to_bf16 does, lane for lane: ties to even, subnormals
// kept (vcvtneps2bf16 would flush them), NaNs kept quiet, the bits and the rounded value both.
TEST(KernelSet, RoundToBf16IsF32ToBf16OnEverySet) {
  std::mt19937 rng(17);
  std::vector<uint32_t> patterns = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00008000u,
                                    0x00018000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x7f7fffffu,
                                    0x7f800000u, 0xff800000u, 0x7f800001u, 0xffc00000u, 0x7fffffffu,
                                    0x7f80ffffu, 0x4b7fffffu};
  while (patterns.size() < 4133) patterns.push_back(uint32_t(rng()));
  const int n = int(patterns.size());
  std::vector<float> in(static_cast<size_t>(n));
  std::memcpy(in.data(), patterns.data(), patterns.size() * 4);
  for (const KernelSet* set : supported_kernel_sets()) {
    std::vector<float> x = in;
    std::vector<uint16_t> b(static_cast<size_t>(n));
    set->round_to_bf16(x.data(), n, b.data());
    for (int i = 0; i < n; ++i) {
      const uint16_t want = f32_to_bf16(in[size_t(i)]);
      ASSERT_EQ(b[size_t(i)], want) << set->name << " input 0x" << std::hex << patterns[size_t(i)];
      ASSERT_EQ(bits(x[size_t(i)]), bits(bf16_to_f32(want)))
          << set->name << " input 0x" << std::hex << patterns[size_t(i)];
    }
    std::vector<float> y = in;
    set->round_to_bf16(y.data(), n, nullptr);  // the values alone
    for (int i = 0; i < n; ++i) ASSERT_EQ(bits(y[size_t(i)]), bits(x[size_t(i)])) << set->name;
  }
}

}  // namespace
}  // namespace r3::kernels
