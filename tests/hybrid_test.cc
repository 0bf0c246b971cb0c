// The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE) as data: their configs (layer types,
// rope parameters, the vision-language wrapper), their checkpoints' layouts (Qwen3-Next's
// projections grouped per key head, Qwen3.5's fused experts, the model.language_model. prefix, the
// vision tower and MTP weights skipped), and the engine's recurrent state (one slot per running
// request, reset when a request starts). Engine-vs-reference agreement and the bitwise solo
// oracle under random schedules run on them with every other family (kAllArchs).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "reference/reference_forward.h"
#include "test_models.h"

namespace r3::testing {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string make_hybrid(const std::string& arch, const std::string& name,
                        const std::string& patch = "") {
  MakeModelOptions o;
  o.arch = arch;
  o.preset = "tiny";
  o.seed = 5;
  o.config_patch = patch;
  o.out = (fs::temp_directory_path() / ("r3_hybrid_" + std::to_string(getpid())) / name).string();
  make_model(o);
  return o.out;
}

// The message of the r3::Error `fn` throws ("" if none).
template <typename F>
std::string error_of(F fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
#define EXPECT_ERROR_MENTIONS(stmt, words) \
  EXPECT_NE(error_of([&] { stmt; }).find(words), std::string::npos) << error_of([&] { stmt; })

float stored_value(const TensorToWrite& t, int64_t i) {
  if (t.dtype == DType::F32) {
    float f;
    std::memcpy(&f, t.bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, t.bytes.data() + 2 * i, 2);
  return bf16_to_f32(h);
}

TEST(HybridConfig, LayerTypesRopeAndTheVisionLanguageWrapper) {
  const ModelConfig next = parse_config(preset_config_json("qwen3_next", "tiny"), "next");
  ASSERT_TRUE(next.deltanet);
  // full_attention_interval 4: layers 0-2 DeltaNet, layer 3 gated full attention.
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(next.layers[size_t(i)].attention.kind,
              i == 3 ? AttentionKind::Gqa : AttentionKind::GatedDeltaNet)
        << i;
  EXPECT_TRUE(next.layers[3].attention.output_gate);
  EXPECT_EQ(next.layers[3].attention.rotary_dim, next.head_dim / 4);  // partial_rotary_factor 0.25
  EXPECT_TRUE(next.zero_centred_norms);
  EXPECT_TRUE(next.deltanet->combined_projections);
  EXPECT_EQ(next.tensor_prefix, "model.");
  const ModelConfig vl = parse_config(preset_config_json("qwen3_5_moe", "tiny"), "vl");
  EXPECT_EQ(vl.tensor_prefix, "model.language_model.");
  EXPECT_TRUE(vl.vision_tower);
  EXPECT_FALSE(vl.deltanet->combined_projections);
  EXPECT_TRUE(vl.norm_topk_prob);  // Qwen3.5 always renormalises
  EXPECT_EQ(vl.rope_theta, 1e7f);  // from text_config.rope_parameters
  EXPECT_EQ(vl.num_mtp_layers, 1);
  // The text class reads the same decoder description.
  const ModelConfig text = parse_config(preset_config_json("qwen3_5_moe_text", "tiny"), "text");
  std::vector<std::string> diff = config_differences(vl, text);
  ASSERT_EQ(diff.size(), 3u);  // the class name, where the tensors live, the vision tower
  EXPECT_NE(diff[0].find("architecture"), std::string::npos);
  EXPECT_NE(diff[1].find("tensor_prefix"), std::string::npos);
  EXPECT_NE(diff[2].find("vision_tower"), std::string::npos);
  // What r3 does not implement is refused by name.
  json j = json::parse(preset_config_json("qwen3_next", "tiny"));
  j["layer_types"] = {"linear_attention", "mamba", "linear_attention", "full_attention"};
  EXPECT_ERROR_MENTIONS(parse_config(j.dump(), "x"), "\"mamba\"");
  j = json::parse(preset_config_json("qwen3_next", "tiny"));
  j["rope_parameters"] = {{"rope_type", "yarn"}};
  EXPECT_ERROR_MENTIONS(parse_config(j.dump(), "x"), "rope_parameters.rope_type");
  j = json::parse(preset_config_json("qwen3_next", "tiny"));
  j["linear_num_value_heads"] = 3;  // not a multiple of the 2 key heads
  EXPECT_ERROR_MENTIONS(parse_config(j.dump(), "x"), "multiple of linear_num_key_heads");
  j = json::parse(preset_config_json("qwen3_5_moe", "tiny"));
  j.erase("text_config");
  EXPECT_ERROR_MENTIONS(parse_config(j.dump(), "x"), "text_config");
}

// Qwen3-Next stores in_proj_qkvz / in_proj_ba grouped per key head; the loader's q, k, v (the
// conv's channel order), z, b and a are exactly those rows, found here from the layout as
// transformers' fix_query_key_value_ordering reads it.
TEST(HybridCheckpoint, QwenNextsGroupedProjectionsAreReadInTheConvsChannelOrder) {
  const std::string dir = make_hybrid("qwen3_next", "next");
  auto ck = Checkpoint::open(dir);
  const ModelConfig& c = ck->config();
  const DeltaNetSpec& d = *c.deltanet;
  const int64_t H = c.hidden_size, dk = d.k_head_dim, dv = d.v_head_dim, r = d.v_heads / d.k_heads;
  const int64_t kd = d.key_dim(), G = 2 * dk + 2 * r * dv;
  std::map<std::string, TensorToWrite> stored;
  for (TensorToWrite& t : ck->stored_tensors()) stored[t.name] = std::move(t);
  const TensorToWrite& qkvz = stored.at("model.layers.0.linear_attn.in_proj_qkvz.weight");
  const TensorToWrite& ba = stored.at("model.layers.0.linear_attn.in_proj_ba.weight");
  const LayerWeights& L = ck->weights().layers[0];
  auto expect_row = [&](const TensorView& v, int64_t row, const TensorToWrite& src, int64_t src_row,
                        const char* what) {
    for (int64_t i = 0; i < H; ++i)
      ASSERT_EQ(v.at(row * H + i), stored_value(src, src_row * H + i)) << what << " row " << row;
  };
  for (int64_t ch = 0; ch < d.conv_dim(); ++ch) {
    int64_t src;
    if (ch < kd)
      src = (ch / dk) * G + ch % dk;  // q of key head ch / dk
    else if (ch < 2 * kd)
      src = ((ch - kd) / dk) * G + dk + (ch - kd) % dk;  // k
    else {                                               // v of value head hv
      const int64_t hv = (ch - 2 * kd) / dv, j = (ch - 2 * kd) % dv;
      src = (hv / r) * G + 2 * dk + (hv % r) * dv + j;
    }
    expect_row(L.dn_qkv, ch, qkvz, src, "qkv");
  }
  for (int64_t hv = 0; hv < d.v_heads; ++hv) {
    for (int64_t j = 0; j < dv; ++j)
      expect_row(L.dn_z, hv * dv + j, qkvz, (hv / r) * G + 2 * dk + r * dv + (hv % r) * dv + j,
                 "z");
    expect_row(L.dn_b, hv, ba, (hv / r) * 2 * r + hv % r, "b");
    expect_row(L.dn_a, hv, ba, (hv / r) * 2 * r + r + hv % r, "a");
  }
}

// make-model draws the vision-language release (text_config, model.language_model., experts fused
// [E, 2I, H] / [E, H, I], a vision tower and MTP weights) and the text-only class (model., one
// tensor per expert) from the same values: both load, skip what they must, and compute the same
// bits, in the reference and in the engine.
TEST(HybridCheckpoint, TheVisionLanguageReleaseAndTheTextClassAreTheSameDecoder) {
  const std::string vl_dir = make_hybrid("qwen3_5_moe", "vl"),
                    text_dir = make_hybrid("qwen3_5_moe_text", "text");
  auto vl = Checkpoint::open(vl_dir);
  auto text = Checkpoint::open(text_dir);
  bool skipped_visual = false, skipped_mtp = false;
  for (const auto& [name, t] : vl->catalog()) {
    skipped_visual |= name.rfind("model.visual.", 0) == 0 && !vl->used_tensors().count(name);
    skipped_mtp |= name.rfind("mtp.", 0) == 0 && !vl->used_tensors().count(name);
  }
  EXPECT_TRUE(skipped_visual && skipped_mtp)
      << "the VL checkpoint lacks the tensors it must skip: the test is vacuous";
  EXPECT_TRUE(vl->used_tensors().count("model.language_model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(text->used_tensors().count("model.layers.0.mlp.experts.0.gate_proj.weight"));
  std::vector<int> tokens;
  for (int i = 0; i < 40; ++i) tokens.push_back((i * 37 + 11) % vl->config().vocab_size);
  const ReferenceResult a = reference_forward(vl->weights(), tokens),
                        b = reference_forward(text->weights(), tokens);
  EXPECT_EQ(a.routes, b.routes);
  EXPECT_EQ(0, std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)));
  EngineConfig cfg;
  cfg.num_kv_blocks = 32;
  cfg.enable_return_routed_experts = true;
  std::vector<std::vector<int>> out;
  for (const std::string& dir : {vl_dir, text_dir}) {
    cfg.model = dir;
    Engine e(cfg);
    EXPECT_TRUE(e.config().enable_prefix_caching);  // hits restore recurrent-state snapshots
    EXPECT_EQ(e.config().max_state_snapshots, 2 * e.config().max_num_seqs);
    out.push_back(
        e.generate({std::vector<int>(tokens.begin(), tokens.begin() + 20)}, {greedy(16)})[0]
            .token_ids);
  }
  EXPECT_EQ(out[0], out[1]);
}

// The engine's recurrent state: each running request holds one of max_num_seqs slots, a request
// starting at position 0 (admitted, or recomputing after preemption) starts from a zero state, and
// the bytes are what DeltaNetSpec::state_floats says. Two requests run together, then a third
// reuses a freed slot: every output equals its solo run.
TEST(HybridEngine, StateSlotsAreReusedAndResetAsRequestsStart) {
  const std::string model = test_model("qwen3_next");
  const ModelConfig mc = load_config(model + "/config.json");
  EngineConfig cfg;
  cfg.model = model;
  cfg.num_kv_blocks = 32;
  cfg.max_num_seqs = 2;
  cfg.enable_return_routed_experts = true;
  Engine e(cfg);
  const uint64_t per_request =
      uint64_t(mc.num_deltanet_layers()) * uint64_t(mc.deltanet->state_floats()) * 4;
  EXPECT_EQ(e.recurrent_state_bytes_per_request(), per_request);
  const std::vector<std::vector<int>> prompts = {{1, 2, 3, 4, 5}, {9, 8, 7}, {4, 4, 4, 4, 4, 4, 4}};
  std::vector<std::vector<int>> solo;
  for (const auto& p : prompts) solo.push_back(e.generate({p}, {greedy(10)})[0].token_ids);
  const auto together = e.generate(prompts, {greedy(10), greedy(10), greedy(10)});
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(together[i].token_ids, solo[i]) << "request " << i;
}

// Prefix caching of the recurrent state (engine/state_snapshots.h), seeded random schedules:
// multi-turn rollouts (each turn's prompt is the previous prompt + its output + new tokens, so a
// hit ends at the snapshot its previous turn left near its end), prompts sharing prefixes cut
// inside and across blocks, chunk sizes 1-64, few or many snapshot slots (eviction), overlap on
// and off, more running requests than a step's tokens. Every output equals its solo run bit for
// bit, and the hits really restored snapshots.
TEST(HybridPrefixCache, HitsRestoreSnapshotsBitForBit) {
  for (const std::string arch : {"qwen3_next", "qwen3_5_moe"}) {
    const std::string model = test_model(arch);
    Engine solo(solo_config(model));
    std::mt19937_64 rng(arch.size() * 7919);
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    uint64_t restores = 0, hit_tokens = 0;
    for (int trial = 0; trial < 6; ++trial) {
      SCOPED_TRACE(arch + " trial " + std::to_string(trial));
      EngineConfig cfg = small_config(model, 96);
      cfg.max_num_batched_tokens = std::vector<int>{1, 3, 16, 24, 64}[size_t(uni(0, 4))];
      cfg.max_num_seqs = uni(2, 6);
      cfg.max_state_snapshots = uni(0, 1) ? 2 : -1;
      cfg.overlap_scheduler = uni(0, 1);
      Engine e(cfg);
      std::vector<int> shared(size_t(uni(20, 50)));
      for (int& t : shared) t = uni(3, 500);
      // Two conversations of three turns, and single prompts cut from the shared prefix.
      std::vector<std::vector<int>> history(2);
      for (int turn = 0; turn < 3; ++turn) {
        std::vector<std::vector<int>> prompts;
        std::vector<SamplingParams> params;
        for (auto& h : history) {
          if (h.empty()) h.assign(shared.begin(), shared.begin() + uni(8, int(shared.size())));
          for (int j = uni(1, 12); j > 0; --j) h.push_back(uni(3, 500));
          prompts.push_back(h);
        }
        for (int j = uni(1, 3); j > 0; --j) {
          std::vector<int> p(shared.begin(), shared.begin() + uni(1, int(shared.size())));
          for (int k = uni(0, 5); k > 0; --k) p.push_back(uni(3, 500));
          prompts.push_back(p);
        }
        for (size_t i = 0; i < prompts.size(); ++i) {
          SamplingParams p = greedy(uni(1, 20));
          if (uni(0, 1)) p.temperature = 1.f, p.seed = rng();
          params.push_back(p);
        }
        const auto got = e.generate(prompts, params);
        for (size_t i = 0; i < prompts.size(); ++i) {
          const RequestOutput want = solo.generate({prompts[i]}, {params[i]})[0];
          expect_matches_solo(got[i], want, false, params[i],
                              "turn " + std::to_string(turn) + " request " + std::to_string(i));
          if (i < history.size())
            history[i].insert(history[i].end(), got[i].token_ids.begin(), got[i].token_ids.end());
        }
      }
      const EngineStats st = e.stats();
      restores += st.state_snapshot_restores;
      hit_tokens += st.prefix_hit_tokens;
      EXPECT_EQ(st.state_snapshots, cfg.max_state_snapshots < 0 ? 2 * cfg.max_num_seqs : 2);
      EXPECT_EQ(st.state_snapshot_bytes,
                uint64_t(st.state_snapshots) * e.recurrent_state_bytes_per_request());
      EXPECT_LE(st.state_snapshots_held, st.state_snapshots);
      EXPECT_GT(st.recurrent_state_bytes_per_request, 0u);
      EXPECT_EQ(st.recurrent_state_bytes_per_request, e.recurrent_state_bytes_per_request());
    }
    EXPECT_GT(restores, 0u) << arch;
    EXPECT_GT(hit_tokens, 0u) << arch;
  }
}

// A hit skips its prefill: with an 896-token prefix cached, a 1,024-token prompt computes only
// its last 128 tokens (the prefill-time figure is r3 bench's; docs/BENCHMARKS.md). Without
// snapshots (max_state_snapshots 0) it computes all of them, and so does a hit whose end has no
// snapshot: the hit is cut back to the last snapshot before it.
TEST(HybridPrefixCache, APrefixHitSkipsItsPrefill) {
  const std::string model = test_model("qwen3_next");
  std::vector<int> prompt(1024);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int(3 + (i * 37) % 400);
  const std::vector<int> prefix(prompt.begin(), prompt.begin() + 896);
  for (int snapshots : {-1, 0}) {
    EngineConfig cfg = small_config(model, 160);
    cfg.max_state_snapshots = snapshots;
    Engine e(cfg);
    const RequestOutput first = e.generate({prefix}, {greedy(1)})[0];
    const uint64_t before = e.stats().computed_tokens;
    const RequestOutput second = e.generate({prompt}, {greedy(1)})[0];
    const uint64_t computed = e.stats().computed_tokens - before;
    if (snapshots != 0) {
      EXPECT_EQ(second.num_cached_tokens, 896);
      EXPECT_EQ(computed, 128u);
    } else {
      EXPECT_EQ(second.num_cached_tokens, 0);
      EXPECT_EQ(computed, 1024u);
    }
    EngineConfig solo_cfg = solo_config(model);
    solo_cfg.num_kv_blocks = 160;
    Engine solo(solo_cfg);
    expect_matches_solo(second, solo.generate({prompt}, {greedy(1)})[0], false, greedy(1),
                        "snapshots " + std::to_string(snapshots));
  }
}

// Refits of a hybrid, from disk and from tensors (every DeltaNet tensor included), with prefix
// caching on: the prompt run before the refit is run again after it, so only a stale snapshot or
// block could make it differ from a fresh engine on the new weights; flush or not, none does
// (snapshot keys start from the weight version, as block hashes do).
TEST(HybridEngine, RefitsFromDiskAndTensorsEqualAFreshEngine) {
  for (const std::string arch : {"qwen3_next", "qwen3_5_moe"}) {
    SCOPED_TRACE(arch);
    const std::string a = test_model(arch, "tiny", 0), b = test_model(arch, "tiny", 7);
    std::vector<int> prompt(40);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int(3 + (i * 53) % 450);
    EngineConfig fresh_cfg = small_config(b);
    const RequestOutput want = Engine(fresh_cfg).generate({prompt}, {greedy(8)})[0];
    for (bool flush : {true, false}) {
      for (bool from_tensors : {false, true}) {
        SCOPED_TRACE(std::string(flush ? "flush" : "no flush") +
                     (from_tensors ? " tensors" : " disk"));
        Engine e(small_config(a));
        const RequestOutput before = e.generate({prompt}, {greedy(8)})[0];
        EXPECT_GT(e.stats().state_snapshots_held, 0);
        if (from_tensors) {
          std::vector<TensorToWrite> all;
          for (const auto& entry : fs::directory_iterator(b))
            if (entry.path().extension() == ".safetensors")
              for (TensorToWrite& t : read_safetensors(entry.path().string()))
                all.push_back(std::move(t));
          e.stage_weights(std::move(all));
          e.commit_staged_weights(flush);
        } else {
          e.update_weights(b, flush);
        }
        const RequestOutput after = e.generate({prompt}, {greedy(8)})[0];
        EXPECT_EQ(after.num_cached_tokens, 0);  // nothing computed under the old weights is reused
        expect_matches_solo(after, want, false, greedy(8), "after the refit");
        EXPECT_NE(before.logprobs, after.logprobs);  // the weights did change
      }
    }
  }
}

}  // namespace
}  // namespace r3::testing
