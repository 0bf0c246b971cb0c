#include "model/config.h"

#include <algorithm>
#include <climits>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace r3 {

using json = nlohmann::json;

std::vector<int> ModelConfig::moe_layers() const {
  std::vector<int> out;
  for (int i = 0; i < num_layers; ++i)
    if (layer_is_moe[size_t(i)]) out.push_back(i);
  return out;
}

int ModelConfig::num_moe_layers() const {
  return int(std::count(layer_is_moe.begin(), layer_is_moe.end(), true));
}

std::string arch_short_name(Arch a) {
  switch (a) {
    case Arch::Mixtral: return "mixtral";
    case Arch::Qwen3Moe: return "qwen3_moe";
    case Arch::Olmoe: return "olmoe";
  }
  return "?";
}

namespace {

// An integer that fits an int (values that do not must not wrap around when narrowed).
bool fits_int(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>() <= uint64_t(INT_MAX);
  if (v.is_number_integer()) return v.get<int64_t>() >= INT_MIN && v.get<int64_t>() <= INT_MAX;
  return false;
}

struct Reader {
  const json& j;
  const std::string& path;

  int req_int(const char* key) const {
    if (!j.contains(key)) throw Error(path + ": missing key \"" + key + "\"");
    if (!fits_int(j[key]) || j[key].get<int64_t>() <= 0)
      throw Error(path + ": key \"" + key + "\" must be a positive integer (32-bit)");
    return j[key].get<int>();
  }
  int opt_int(const char* key, int dflt) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!fits_int(j[key])) throw Error(path + ": key \"" + key + "\" must be an integer (32-bit)");
    return j[key].get<int>();
  }
  float opt_float(const char* key, float dflt) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!j[key].is_number()) throw Error(path + ": key \"" + key + "\" must be a number");
    return j[key].get<float>();
  }
  bool opt_bool(const char* key, bool dflt) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!j[key].is_boolean()) throw Error(path + ": key \"" + key + "\" must be a boolean");
    return j[key].get<bool>();
  }
  // eos_token_id may be an int or a list (first one is used for stopping; all are kept by
  // callers through stop_token_ids).
  int token_id(const char* key) const {
    if (!j.contains(key) || j[key].is_null()) return -1;
    if (fits_int(j[key])) return j[key].get<int>();
    if (j[key].is_array() && !j[key].empty() && fits_int(j[key][0]))
      return j[key][0].get<int>();
    throw Error(path + ": key \"" + key + "\" must be an integer or a list of integers");
  }
};

}  // namespace

ModelConfig parse_config(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(path + ": malformed JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(path + ": not a JSON object");
  Reader r{j, path};
  ModelConfig c;
  std::string arch;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  else
    throw Error(path + ": missing \"architectures\" (a list naming the model class)");
  c.architecture = arch;
  if (arch == "MixtralForCausalLM") c.arch = Arch::Mixtral;
  else if (arch == "Qwen3MoeForCausalLM") c.arch = Arch::Qwen3Moe;
  else if (arch == "OlmoeForCausalLM") c.arch = Arch::Olmoe;
  else
    throw Error(path + ": unknown architecture \"" + arch +
                "\" (r3 supports MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM)");

  c.vocab_size = r.req_int("vocab_size");
  c.hidden_size = r.req_int("hidden_size");
  c.num_layers = r.req_int("num_hidden_layers");
  c.num_heads = r.req_int("num_attention_heads");
  c.num_kv_heads = r.opt_int("num_key_value_heads", c.num_heads);
  c.head_dim = r.opt_int("head_dim", c.hidden_size / c.num_heads);
  c.top_k = r.req_int("num_experts_per_tok");
  c.rope_theta = r.opt_float("rope_theta", c.arch == Arch::Mixtral ? 1e6f : 10000.f);
  c.rms_norm_eps = r.opt_float("rms_norm_eps", c.arch == Arch::Mixtral ? 1e-5f : 1e-6f);
  c.tie_word_embeddings = r.opt_bool("tie_word_embeddings", false);
  c.max_position_embeddings = r.opt_int("max_position_embeddings", 4096);
  c.eos_token_id = r.token_id("eos_token_id");
  c.bos_token_id = r.token_id("bos_token_id");
  if (c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0)
    throw Error(path + ": num_attention_heads must be a multiple of num_key_value_heads");
  if (c.head_dim <= 0 || c.head_dim % 2) throw Error(path + ": head_dim must be positive and even");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    throw Error(path + ": rope_scaling is not supported by r3 yet");

  c.layer_is_moe.assign(size_t(c.num_layers), true);
  switch (c.arch) {
    case Arch::Mixtral:
      c.num_experts = r.req_int("num_local_experts");
      c.moe_intermediate_size = r.req_int("intermediate_size");
      c.norm_topk_prob = true;
      c.qk_norm = QkNorm::None;
      break;
    case Arch::Qwen3Moe: {
      c.num_experts = r.opt_int("num_experts", 0);
      c.moe_intermediate_size = r.req_int("moe_intermediate_size");
      c.intermediate_size = r.opt_int("intermediate_size", 0);
      c.norm_topk_prob = r.opt_bool("norm_topk_prob", false);
      c.qk_norm = QkNorm::PerHead;
      int step = r.opt_int("decoder_sparse_step", 1);
      if (step <= 0) throw Error(path + ": decoder_sparse_step must be positive");
      std::vector<int> mlp_only;
      if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
        if (!j["mlp_only_layers"].is_array()) throw Error(path + ": mlp_only_layers must be a list");
        for (auto& v : j["mlp_only_layers"]) {
          if (!fits_int(v)) throw Error(path + ": mlp_only_layers must hold integers");
          mlp_only.push_back(v.get<int>());
        }
      }
      for (int i = 0; i < c.num_layers; ++i) {
        bool only = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end();
        c.layer_is_moe[size_t(i)] = !only && c.num_experts > 0 && (i + 1) % step == 0;
      }
      for (int i = 0; i < c.num_layers; ++i)
        if (!c.layer_is_moe[size_t(i)] && c.intermediate_size <= 0)
          throw Error(path + ": layer " + std::to_string(i) +
                      " is dense but \"intermediate_size\" is missing");
      break;
    }
    case Arch::Olmoe:
      c.num_experts = r.req_int("num_experts");
      c.moe_intermediate_size = r.req_int("intermediate_size");
      c.norm_topk_prob = r.opt_bool("norm_topk_prob", false);
      c.qk_norm = QkNorm::Whole;
      if (j.contains("clip_qkv") && !j["clip_qkv"].is_null()) {
        if (!j["clip_qkv"].is_number()) throw Error(path + ": clip_qkv must be a number or null");
        c.clip_qkv = j["clip_qkv"].get<float>();
      }
      break;
  }
  if (c.num_experts > 0 && c.top_k > c.num_experts)
    throw Error(path + ": num_experts_per_tok exceeds the number of experts");
  if (c.num_moe_layers() == 0) throw Error(path + ": the model has no MoE layer");
  if (c.num_experts > 32767) throw Error(path + ": more than 32767 experts do not fit int16 routes");
  return c;
}

ModelConfig load_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open config.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path);
}

}  // namespace r3
