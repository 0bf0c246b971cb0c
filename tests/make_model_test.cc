// make-model's full presets (issue 42) carry the released models' shapes, key for key as their
// config.json files give them (OLMoE-1B-7B-0924, Qwen3-30B-A3B, gpt-oss-20b), and parse as r3
// models; architectures without a full preset are refused by name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/make_model.h"

namespace r3 {
namespace {

using json = nlohmann::json;

void expect_keys(const std::string& arch, const json& released) {
  const json j = json::parse(preset_config_json(arch, "full"));
  for (auto it = released.begin(); it != released.end(); ++it)
    EXPECT_EQ(j.value(it.key(), json()), it.value()) << arch << " " << it.key();
  (void)parse_config(j.dump(), arch + " full");  // a model r3 loads
}

TEST(MakeModel, FullPresetsHaveTheReleasedShapes) {
  expect_keys("olmoe", {{"hidden_size", 2048},
                        {"num_hidden_layers", 16},
                        {"num_attention_heads", 16},
                        {"num_key_value_heads", 16},
                        {"num_experts", 64},
                        {"num_experts_per_tok", 8},
                        {"intermediate_size", 1024},
                        {"vocab_size", 50304},
                        {"rope_theta", 10000.0},
                        {"rms_norm_eps", 1e-5},
                        {"norm_topk_prob", false},
                        {"tie_word_embeddings", false},
                        {"max_position_embeddings", 4096},
                        {"clip_qkv", nullptr}});
  expect_keys("qwen3_moe", {{"hidden_size", 2048},
                            {"num_hidden_layers", 48},
                            {"num_attention_heads", 32},
                            {"num_key_value_heads", 4},
                            {"head_dim", 128},
                            {"num_experts", 128},
                            {"num_experts_per_tok", 8},
                            {"moe_intermediate_size", 768},
                            {"intermediate_size", 6144},
                            {"vocab_size", 151936},
                            {"rope_theta", 1000000.0},
                            {"mlp_only_layers", json::array()},
                            {"norm_topk_prob", true},
                            {"tie_word_embeddings", false},
                            {"max_position_embeddings", 40960}});
  expect_keys("gpt_oss", {{"hidden_size", 2880},
                          {"num_hidden_layers", 24},
                          {"num_attention_heads", 64},
                          {"num_key_value_heads", 8},
                          {"head_dim", 64},
                          {"num_local_experts", 32},
                          {"num_experts_per_tok", 4},
                          {"intermediate_size", 2880},
                          {"vocab_size", 201088},
                          {"sliding_window", 128},
                          {"rope_theta", 150000.0},
                          {"max_position_embeddings", 131072},
                          {"swiglu_limit", 7.0}});
  const json rope = json::parse(preset_config_json("gpt_oss", "full"))["rope_scaling"];
  EXPECT_EQ(rope["factor"], 32.0);
  EXPECT_EQ(rope["original_max_position_embeddings"], 4096);
  EXPECT_THROW(preset_config_json("mixtral", "full"), Error);
}

}  // namespace
}  // namespace r3
