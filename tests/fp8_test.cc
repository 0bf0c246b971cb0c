// Block-scaled FP8 weights (DeepSeek-V3, Kimi-K2 and Qwen3 FP8 as released): the e4m3 codec, the
// checkpoint's view against the file's bytes, and the engine against the same weights decoded
// into a bf16 checkpoint: identical tokens, logprobs and routes. (EngineFuzz runs the
// everything-on schedule on deepseek_v3_fp8, EngineVsReference compares it with the fp32
// reference forward, and WeightSync refits it in part.)
#include <gtest/gtest.h>

#include <filesystem>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/panel_layout.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/checkpoint.h"
#include "test_models.h"

namespace r3::testing {
namespace {

TEST(Fp8, E4m3CodecRoundTripsEveryCodeAndRoundsToNearestEven) {
  for (int b = 0; b < 256; ++b) {
    if (e4m3_is_nan(uint8_t(b))) {
      EXPECT_TRUE(std::isnan(e4m3_to_f32(uint8_t(b))));
      continue;
    }
    EXPECT_EQ(f32_to_e4m3(e4m3_to_f32(uint8_t(b))), b) << b;
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(e4m3_to_f32(0xb8), -1.f);
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);   // halfway 1 .. 1.125: to the even code (1)
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3a);   // halfway 1.125 .. 1.25: to the even code (1.25)
  EXPECT_EQ(f32_to_e4m3(0x1p-10f), 0x00);  // halfway 0 .. 2^-9
  EXPECT_EQ(f32_to_e4m3(1e6f), 0x7e);      // saturates
  EXPECT_EQ(f32_to_e4m3(-1e6f), 0xfe);
}

// The decoders build floats from bits instead of calling ldexp: every e4m3 code and every
// (MXFP4 nibble, scale) pair, signed zeros and the ldexp-only scales 0 and 255 included, gives
// exactly the bits of the ldexp definitions (the format's).
TEST(Fp8, DecodersGiveTheLdexpDefinitionsBits) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) continue;  // NaN: checked above
    const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
    ASSERT_EQ(bits(e4m3_to_f32(uint8_t(b))), bits(b & 0x80 ? -v : v)) << b;
  }
  for (int s = 0; s < 256; ++s)
    for (int n = 0; n < 16; ++n)
      ASSERT_EQ(bits(mxfp4_value(uint8_t(n), uint8_t(s))),
                bits(std::ldexp(kE2m1Values[n], s - 127)))
          << n << " " << s;
}

// The view multiplies each e4m3 value by its own block's scale (rows by block_rows, columns by
// block_cols: the test block is uneven so a swap shows), and the dequantized checkpoint holds
// exactly the bf16 rounding of those products.
// The word-at-a-time NaN scan a refit runs over every FP8 code finds the first NaN (0x7f or
// 0xff) wherever it lies, the tail past the last whole word included, and nothing among the
// other 254 codes (0x7e and 0xfe, the largest finite ones, sit next to it).
TEST(Fp8, FirstNanCodeIsFoundAnywhere) {
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if (!e4m3_is_nan(uint8_t(c))) codes.push_back(uint8_t(c));
  ASSERT_EQ(codes.size(), 254u);
  for (int n : {0, 1, 7, 8, 9, 254, 259}) {
    std::vector<uint8_t> b(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) b[size_t(i)] = codes[size_t(i) % codes.size()];
    EXPECT_EQ(first_e4m3_nan(b.data(), n), -1) << n;
    for (int at = 0; at < n; ++at)
      for (uint8_t nan : {uint8_t(0x7f), uint8_t(0xff)}) {
        std::vector<uint8_t> c = b;
        c[size_t(at)] = nan;
        if (at + 9 < n) c[size_t(at + 9)] = 0x7f;  // a NaN in a later word does not hide the first
        ASSERT_EQ(first_e4m3_nan(c.data(), n), at) << n << " " << at << " " << int(nan);
      }
  }
}

TEST(Fp8, CheckpointDecodesAsTransformersDequantizes) {
  for (const char* arch : {"deepseek_v3", "qwen3_moe"}) {
    SCOPED_TRACE(arch);
    auto q = Checkpoint::open(test_model(std::string(arch) + "_fp8"));
    auto d = Checkpoint::open(test_model(std::string(arch) + "_fp8_dequantized"));
    ASSERT_EQ(q->config().fp8_block_rows, 32);
    ASSERT_EQ(q->config().fp8_block_cols, 48);
    const LayerWeights& L = q->weights().layers[1];
    const TensorView& w = L.experts[2].down;
    ASSERT_EQ(w.dtype, DType::F8_E4M3);
    ASSERT_TRUE(w.scale_inv);
    EXPECT_EQ(q->weights().lm_head.dtype, DType::BF16);  // not quantized, as released
    EXPECT_EQ(L.router.dtype, DType::BF16);
    const int64_t O = w.shape[0], I = w.shape[1];
    ASSERT_EQ(w.data,
              nullptr);  // its panels are the only copy; read back, they give the stored codes
    std::vector<uint8_t> bytes;
    for (const auto& f :
         std::filesystem::directory_iterator(test_model(std::string(arch) + "_fp8")))
      if (f.path().extension() == ".safetensors")
        for (const TensorToWrite& t : read_safetensors(f.path().string()))
          if (t.name == w.name) bytes = t.bytes;
    ASSERT_EQ(bytes.size(), size_t(O * I));
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < I; ++i)
        ASSERT_EQ(w.at(o * I + i), e4m3_to_f32(bytes[size_t(o * I + i)]) *
                                       w.scale_inv[o / 32 * ((I + 47) / 48) + i / 48]);
    std::vector<float> row(static_cast<size_t>(
        I));  // a whole row read back at once (the reference forward's way) is the same
    for (int64_t o = 0; o < O; ++o) {
      packed_row(w, o, row.data());
      for (int64_t i = 0; i < I; ++i) ASSERT_EQ(row[size_t(i)], w.at(o * I + i)) << o << " " << i;
    }
    const std::vector<std::pair<const TensorView*, const TensorView*>> pairs = {
        {&L.experts[2].down, &d->weights().layers[1].experts[2].down},
        {&L.o, &d->weights().layers[1].o},
        {&L.shared.gate, &d->weights().layers[1].shared.gate},
        {&q->weights().layers[0].dense.up, &d->weights().layers[0].dense.up}};
    for (auto [a, b] : pairs) {
      if (a->empty()) continue;  // qwen3_moe has no shared expert, no dense layer in tiny
      ASSERT_EQ(b->dtype, DType::BF16);
      for (int64_t k = 0; k < a->numel(); ++k)
        ASSERT_EQ(f32_to_bf16(a->at(k)), f32_to_bf16(b->at(k))) << a->name << " " << k;
    }
    if (q->config().mla) {  // kv_b is served decoded (the engine splits it per head)
      EXPECT_EQ(L.kv_b.dtype, DType::BF16);
      EXPECT_EQ(std::memcmp(L.kv_b.data, d->weights().layers[1].kv_b.data, L.kv_b.nbytes()), 0);
    }
  }
}

TEST(Fp8, EngineIdenticalToTheDequantizedCheckpoint) {
  for (const char* arch :
       {"deepseek_v3", "qwen3_moe", "glm4_moe", "mixtral", "qwen2_moe", "olmoe"}) {
    SCOPED_TRACE(arch);
    const std::string fp8 = test_model(std::string(arch) + "_fp8");
    EXPECT_EQ(Engine(small_config(fp8)).config().kv_cache_dtype,
              "bf16");  // auto: FP8 weights compute as bf16
    expect_identical_runs(fp8, test_model(std::string(arch) + "_fp8_dequantized"), 37, 16);
  }
}

// An update whose FP8 values or scales the loader would refuse is refused before anything is
// taken over: the engine keeps serving the weights it had.
TEST(Fp8, ARefitWithANaNCodeOrABadScaleChangesNothing) {
  const std::string model = test_model("deepseek_v3_fp8");
  auto ck = Checkpoint::open(model);
  EngineConfig cfg = small_config(model, 40);
  Engine e(cfg);
  SamplingParams p;
  p.max_tokens = 6;
  p.temperature = 0;
  const RequestOutput before = e.generate({{3, 4, 5, 6}}, {p})[0];
  for (const char* which : {"values", "scale"}) {
    SCOPED_TRACE(which);
    std::vector<TensorToWrite> all = ck->stored_tensors(), bucket;
    for (TensorToWrite& t : all) {
      if (t.name == "model.layers.1.self_attn.o_proj.weight" && std::string(which) == "values") {
        t.bytes[3] = 0x7f;
        bucket.push_back(t);
      }
      if (t.name == "model.layers.1.self_attn.o_proj.weight_scale_inv" &&
          std::string(which) == "scale") {
        const float bad = NAN;
        std::memcpy(t.bytes.data(), &bad, 4);
        bucket.push_back(t);
      }
    }
    ASSERT_EQ(bucket.size(), 1u);
    EXPECT_THROW(e.stage_weights(bucket), Error);
    EXPECT_EQ(e.generate({{3, 4, 5, 6}}, {p})[0].logprobs, before.logprobs);
  }
}

}  // namespace
}  // namespace r3::testing
