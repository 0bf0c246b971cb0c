// The engine fails closed: a refit that changes anything the engine's buffers or tables depend
// on is refused (the old weights keep serving), files rewritten under a running engine change
// nothing, and a non-finite logit fails its request instead of being sampled from.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/safetensors.h"
#include "test_models.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::greedy;
using testing::test_model;

std::string copy_model(const std::string& src, const std::string& name) {
  return testing::copy_test_model(src, "r3_fail_closed", name);
}

void set_config_key(const std::string& dir, const std::string& key, const json& value) {
  const fs::path cfg = fs::path(dir) / "config.json";
  std::ifstream in(cfg);
  json j = json::parse(in);
  (j.contains("text_config") ? j["text_config"] : j)[key] = value;  // a VL release's decoder keys
  std::ofstream(cfg, std::ios::trunc) << j.dump();
}

EngineConfig config_for(const std::string& model) { return testing::small_config(model); }

// Each config key in turn: the refit is refused naming the key, the weight version stays, and
// the engine answers exactly as before.
TEST(FailClosedRefit, EveryConfigKeyChangeIsRefusedAndTheOldWeightsServe) {
  for (const std::string& arch : testing::kAllArchs) {
    const std::string served = test_model(arch, "small");
    Engine e(config_for(served));
    const RequestOutput before = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
    json cfg;
    {
      std::ifstream in(fs::path(served) / "config.json");
      cfg = json::parse(in);
      if (cfg.contains("text_config")) cfg = cfg["text_config"];  // a VL release's decoder keys
    }
    std::vector<std::pair<std::string, json>> changes = {
        {"rope_theta", cfg.value("rope_theta", 10000.0) * 2},
        {"max_position_embeddings", cfg["max_position_embeddings"].get<int>() * 8},
        {"rms_norm_eps", 1e-3},
        {"eos_token_id", 7},
        {"bos_token_id", 9},
        {"num_experts_per_tok", 1},
        {"intermediate_size", cfg.value("intermediate_size", 64) * 2},
    };
    // GptOssConfig has no norm_topk_prob (the key is ignored, as transformers ignores it).
    // Qwen3.5 always renormalises (no such key either).
    if (arch != "mixtral" && arch != "gpt_oss" && arch != "qwen3_5_moe")
      changes.push_back({"norm_topk_prob", !cfg.value("norm_topk_prob", false)});
    if (arch == "gpt_oss")
      for (auto& [key, value] : std::vector<std::pair<std::string, json>>{
               {"sliding_window", 4},
               {"swiglu_limit", 5.0},
               {"layer_types", json::array({"full_attention", "full_attention"})},
               {"attention_bias", false}})
        changes.push_back({key, value});
    if (arch == "olmoe") changes.push_back({"clip_qkv", 3.0});
    // Qwen3.5 states its layer types and its rope in rope_parameters, which win over
    // full_attention_interval and a top-level rope_theta (as in transformers).
    if (arch == "qwen3_next") changes.push_back({"full_attention_interval", 2});
    if (arch == "qwen3_5_moe") {
      json rope = cfg["rope_parameters"];
      rope["rope_theta"] = rope["rope_theta"].get<double>() * 2;
      changes.push_back({"rope_parameters", rope});
      rope = cfg["rope_parameters"];
      rope["partial_rotary_factor"] = 0.5;
      changes.push_back({"rope_parameters", rope});
    }
    if (testing::is_hybrid(arch))
      for (auto& [key, value] : std::vector<std::pair<std::string, json>>{
               {"linear_num_value_heads", cfg["linear_num_key_heads"].get<int>()},
               {"linear_conv_kernel_dim", 3},
               {"shared_expert_intermediate_size",
                cfg["shared_expert_intermediate_size"].get<int>() * 2},
               {"partial_rotary_factor", 0.5},
               {"layer_types", json::array({"full_attention", "linear_attention",
                                            "linear_attention", "full_attention"})}})
        changes.push_back({key, value});
    if (arch == "qwen3_moe" || arch == "qwen2_moe")
      changes.push_back({"mlp_only_layers", json::array({0, 1})});
    if (arch == "qwen2_moe") changes.push_back({"shared_expert_intermediate_size", 64});
    if (arch == "glm4_moe")
      for (auto& [key, value] :
           std::vector<std::pair<std::string, json>>{{"routed_scaling_factor", 1.0},
                                                     {"n_group", 2},
                                                     {"topk_group", 3},
                                                     {"partial_rotary_factor", 1.0},
                                                     {"first_k_dense_replace", 2},
                                                     {"n_shared_experts", 2},
                                                     {"use_qk_norm", false},
                                                     {"attention_bias", false}})
        changes.push_back({key, value});
    if (arch ==
        "qwen3_5_moe")  // rope_parameters holds them (above): the top-level keys change nothing
      std::erase_if(changes, [](const auto& kv) {
        return kv.first == "rope_theta" || kv.first == "partial_rotary_factor";
      });
    for (auto& [key, value] : changes) {
      SCOPED_TRACE(arch + " " + key + " = " + value.dump());
      const std::string dir = copy_model(served, "refit_" + arch);
      set_config_key(dir, key, value);
      try {
        e.update_weights(dir, true);
        ADD_FAILURE() << "refit accepted";
      } catch (const Error& err) {
        // Either the description differs (named) or the new checkpoint does not even load.
        EXPECT_FALSE(std::string(err.what()).empty());
      }
      EXPECT_EQ(e.weight_version(), 0u);
      const RequestOutput after = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
      EXPECT_EQ(after.token_ids, before.token_ids);
      EXPECT_EQ(after.logprobs, before.logprobs);
      EXPECT_EQ(after.routed_experts->data, before.routed_experts->data);
    }
  }
}

TEST(FailClosedRefit, RefusalNamesTheKeyAndSameDescriptionIsAccepted) {
  const std::string served = test_model("olmoe", "tiny");
  Engine e(config_for(served));
  const std::string dir = copy_model(served, "refit_named");
  set_config_key(dir, "rope_theta", 20000.0);
  try {
    e.update_weights(dir, true);
    ADD_FAILURE() << "refit accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("rope_theta"), std::string::npos) << err.what();
  }
  // Other weights, same description: accepted, and the engine then equals a fresh one on them.
  const std::string other = test_model("olmoe", "tiny", 7);
  e.update_weights(other, true);
  EXPECT_EQ(e.weight_version(), 1u);
  Engine fresh(config_for(other));
  EXPECT_EQ(e.generate({{3, 4, 5}}, {greedy(5)})[0].token_ids,
            fresh.generate({{3, 4, 5}}, {greedy(5)})[0].token_ids);
}

// The engine computes from its own copy: truncating or rewriting the files under it (as a
// trainer saving in place does) changes nothing until a refit.
TEST(FailClosedWeights, FilesRewrittenUnderARunningEngineChangeNothing) {
  const std::string dir = copy_model(test_model("mixtral", "tiny"), "rewrite");
  Engine e(config_for(dir));
  const RequestOutput before = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
  const fs::path st = fs::path(dir) / "model.safetensors";
  const auto size = fs::file_size(st);
  fs::resize_file(st, 0);  // a mapping of this file would now fault with SIGBUS
  EXPECT_EQ(e.generate({{3, 4, 5, 6}}, {greedy(6)})[0].token_ids, before.token_ids);
  std::ofstream(st, std::ios::binary | std::ios::trunc)
      << std::string(size, '\x7f');  // same size, new bytes
  const RequestOutput after = e.generate({{3, 4, 5, 6}}, {greedy(6)})[0];
  EXPECT_EQ(after.token_ids, before.token_ids);
  EXPECT_EQ(after.logprobs, before.logprobs);
}

// One embedding row of NaN: requests whose prompt holds that token fail with a clear error and
// no routes; the others in the same steps are untouched (equal to their solo runs).
TEST(FailClosedValues, NonFiniteLogitsFailTheRequestNotTheBatch) {
  const std::string dir = copy_model(test_model("olmoe", "tiny"), "nan");
  const fs::path st = fs::path(dir) / "model.safetensors";
  {
    std::vector<TensorToWrite> out;
    for (const TensorToWrite& t : read_safetensors(st.string())) {
      const std::string& name = t.name;
      TensorToWrite w = t;
      if (name == "model.embed_tokens.weight") {
        const size_t row = size_t(t.shape[1]) * dtype_size(t.dtype);
        for (size_t i = 0; i < row; i += 2) {  // bf16 NaN
          w.bytes[row * 7 + i] = 0xc0;
          w.bytes[row * 7 + i + 1] = 0x7f;
        }
      }
      out.push_back(std::move(w));
    }
    write_safetensors(st.string(), out);
  }
  EngineConfig c = config_for(dir);
  c.max_num_seqs = 4;
  Engine e(c);
  const uint64_t bad = e.add_request({3, 7, 5}, greedy(4));
  const uint64_t good = e.add_request({3, 4, 5}, greedy(4));
  std::map<uint64_t, RequestOutput> done;
  while (e.has_unfinished())
    for (auto& o : e.step())
      if (o.finished) done[o.request_id] = o;
  EXPECT_EQ(done[bad].finish_reason, "error");
  EXPECT_NE(done[bad].error.find("non-finite logits"), std::string::npos) << done[bad].error;
  EXPECT_TRUE(done[bad].token_ids.empty());
  EXPECT_FALSE(done[bad].routed_experts.has_value());
  Engine solo(testing::solo_config(dir));
  EXPECT_EQ(done[good].token_ids, solo.generate({{3, 4, 5}}, {greedy(4)})[0].token_ids);
  EXPECT_EQ(done[good].finish_reason, "length");
  EXPECT_EQ(e.stats().free_blocks, e.stats().num_blocks);
}

// Issue 48: a NaN logit loses every comparison, so a check on the log-normaliser alone let it be
// dropped; a NaN router score would quietly route around itself. Both now fail the request that
// meets them with the non-finite-logits error (lm_head: one token's row; router: one expert's
// row, which every token scores).
TEST(FailClosedValues, NanInTheHeadOrTheRouterFailsTheRequest) {
  for (const std::string tensor : {"lm_head.weight", "model.layers.0.mlp.gate.weight"}) {
    SCOPED_TRACE(tensor);
    const std::string dir = copy_model(test_model("olmoe", "tiny"), "nan_row");
    const fs::path st = fs::path(dir) / "model.safetensors";
    {
      std::vector<TensorToWrite> out;
      for (const TensorToWrite& t : read_safetensors(st.string())) {
        const std::string& name = t.name;
        TensorToWrite w = t;
        if (name == tensor) {
          const size_t row = size_t(t.shape[1]) * dtype_size(t.dtype);
          ASSERT_GT(t.shape[0], 1);
          for (size_t i = 0; i < row;
               i += dtype_size(t.dtype)) {  // row 1: NaN (bf16, or f32's high half)
            w.bytes[row + i + dtype_size(t.dtype) - 2] = 0xc0;
            w.bytes[row + i + dtype_size(t.dtype) - 1] = 0x7f;
          }
        }
        out.push_back(std::move(w));
      }
      write_safetensors(st.string(), out);
    }
    Engine e(config_for(dir));
    const RequestOutput o = e.generate({{3, 4, 5}}, {greedy(4)})[0];
    EXPECT_EQ(o.finish_reason, "error");
    EXPECT_NE(o.error.find("non-finite logits"), std::string::npos) << o.error;
    EXPECT_FALSE(o.routed_experts.has_value());
  }
}

}  // namespace
}  // namespace r3

namespace r3 {
namespace {

// A KV pool larger than the machine is refused when the engine is built, naming both sizes and
// the options, instead of starting (its memory is committed only as written) and failing later.
TEST(FailClosedConfig, KvCacheLargerThanTheMachineIsRefused) {
  EngineConfig c = config_for(test_model("olmoe"));
  c.block_size = 4096;
  c.num_kv_blocks = 1 << 16;  // hundreds of GiB of KV at any model width
  try {
    Engine e(c);
    ADD_FAILURE() << "an engine with a KV cache larger than the machine was built";
  } catch (const Error& err) {
    const std::string what = err.what();
    EXPECT_NE(what.find("exceeds this machine's memory"), std::string::npos) << what;
    EXPECT_NE(what.find("--num-kv-blocks"), std::string::npos) << what;
  }
  c.num_kv_blocks = 64;  // the same model and block size within the machine: built
  Engine ok(c);
  EXPECT_EQ(ok.config().num_kv_blocks, 64);
}

}  // namespace
}  // namespace r3
