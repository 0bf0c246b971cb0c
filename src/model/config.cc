#include "model/config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "core/error.h"
#include "core/file_read.h"
#include "core/json_limits.h"
#include "model/families.h"

namespace r3 {

using json = nlohmann::json;

std::vector<int> ModelConfig::moe_layers() const {
  std::vector<int> out;
  for (int i = 0; i < num_layers; ++i)
    if (layers[size_t(i)].moe) out.push_back(i);
  return out;
}

std::vector<double> rope_inv_freq(const ModelConfig& c, int rotary_dim) {
  const int dim = rotary_dim, half = dim / 2;
  std::vector<double> out(static_cast<size_t>(half));
  const RopeScaling& y = c.rope_scaling;
  if (!y.yarn) {
    for (int i = 0; i < half; ++i)
      out[size_t(i)] = std::pow(double(c.rope_theta), -2.0 * i / double(dim));
    return out;
  }
  const double base = c.rope_theta, pi = 3.14159265358979323846;
  auto correction_dim = [&](double rotations) {
    return dim * std::log(double(y.original_max_position_embeddings) / (rotations * 2 * pi)) /
           (2 * std::log(base));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    const double pos_freq = std::pow(base, 2.0 * i / double(dim));
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;  // weight of the unscaled frequency
    out[size_t(i)] =
        (1.0 / (y.factor * pos_freq)) * (1.0 - extrapolation) + (1.0 / pos_freq) * extrapolation;
  }
  return out;
}

int64_t ModelConfig::kv_cache_width() const {
  if (mla) return mla->latent_width();
  return 2 * int64_t(num_kv_heads) * head_dim;
}

int ModelConfig::num_deltanet_layers() const {
  return int(std::count_if(layers.begin(), layers.end(), [](const LayerConfig& l) {
    return l.attention.kind == AttentionKind::GatedDeltaNet;
  }));
}

int ModelConfig::num_moe_layers() const {
  return int(
      std::count_if(layers.begin(), layers.end(), [](const LayerConfig& l) { return l.moe; }));
}

std::string arch_short_name(Arch a) {
  for (const Family& f : families())
    if (f.arch == a) return f.name;
  return "unknown";
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
    if (j[key].is_array() && !j[key].empty() && fits_int(j[key][0])) return j[key][0].get<int>();
    throw Error(path + ": key \"" + key + "\" must be an integer or a list of integers");
  }
};

// Keys that change the model in ways r3 does not implement: refused by name whenever present with
// a value other than the neutral one, unless the architecture reads them (reads_key). The keys
// of the supported architectures' Hugging Face config classes are all either read below (and
// refused where r3 lacks the feature: attention_bias, sliding windows, rope_scaling types,
// hidden_act) or without effect on inference outputs (initializer_range, use_cache,
// router_aux_loss_coef, router_jitter_noise, ...). Keys that no such class reads cannot change
// the model and are ignored, as transformers ignores them.
const char* const kUnimplemented[] = {"quantization_config",
                                      "pretraining_tp",
                                      "partial_rotary_factor",
                                      "rope_parameters",
                                      "layer_types",
                                      "shared_expert_intermediate_size",
                                      "n_shared_experts",
                                      "first_k_dense_replace",
                                      "num_nextn_predict_layers",
                                      "attention_sink",
                                      "mlp_bias",
                                      "qk_layernorm",
                                      "logits_scaling",
                                      "embedding_multiplier",
                                      "residual_multiplier",
                                      "attention_multiplier"};

bool reads_key(Arch a, const std::string& key) {
  if (key == "quantization_config") return true;  // parse_quantization
  if (a == Arch::Qwen2Moe) return key == "shared_expert_intermediate_size";
  if (a == Arch::Glm4Moe)
    return key == "partial_rotary_factor" || key == "n_shared_experts" ||
           key == "first_k_dense_replace" || key == "num_nextn_predict_layers";
  if (a == Arch::DeepseekV3)
    return key == "n_shared_experts" || key == "first_k_dense_replace" ||
           key == "num_nextn_predict_layers";
  if (a == Arch::GptOss) return key == "layer_types";
  if (a == Arch::Qwen3Next || a == Arch::Qwen3_5Moe)
    return key == "layer_types" || key == "shared_expert_intermediate_size" ||
           key == "partial_rotary_factor" || key == "rope_parameters";
  return false;
}

// YaRN as transformers computes it: factor (which must equal max_position_embeddings /
// original_max_position_embeddings when both are given: transformers versions differ on which
// one wins), beta_fast / beta_slow, truncate, and attention_factor from mscale / mscale_all_dim
// when not given. Any other key is refused.
RopeScaling parse_yarn(const json& rs, int max_position_embeddings, const std::string& path) {
  static const char* const known[] = {
      "rope_type",        "type",      "factor", "original_max_position_embeddings",
      "beta_fast",        "beta_slow", "mscale", "mscale_all_dim",
      "attention_factor", "truncate"};
  for (auto it = rs.begin(); it != rs.end(); ++it) {
    const std::string& key =
        it.key();  // not a structured binding: clang 14 (scripts/fuzz.sh) cannot capture one
    if (std::find_if(std::begin(known), std::end(known), [&](const char* k) { return key == k; }) ==
        std::end(known))
      throw Error(path + ": key \"rope_scaling\" holds \"" + key +
                  "\", which is not implemented by r3 for yarn");
  }
  auto number = [&](const char* key, double dflt) {
    if (!rs.contains(key) || rs[key].is_null()) return dflt;
    if (!rs[key].is_number()) throw Error(path + ": rope_scaling." + key + " must be a number");
    const double v = rs[key].get<double>();
    if (!(std::isfinite(v) && v >= 0))
      throw Error(path + ": rope_scaling." + key + " must be a finite number >= 0");
    return v;
  };
  RopeScaling y;
  y.yarn = true;
  y.factor = number("factor", 0);
  if (!(y.factor >= 1.0 && y.factor <= 4096.0))
    throw Error(path + ": rope_scaling.factor must be in [1, 4096]");
  const double original =
      number("original_max_position_embeddings", double(max_position_embeddings));
  y.original_max_position_embeddings = int(original);
  if (y.original_max_position_embeddings < 2 ||
      double(y.original_max_position_embeddings) != original)
    throw Error(path + ": rope_scaling.original_max_position_embeddings must be an integer >= 2");
  if (rs.contains("original_max_position_embeddings") &&
      std::fabs(double(max_position_embeddings) / original - y.factor) > 1e-6 * y.factor)
    throw Error(
        path + ": rope_scaling.factor " + std::to_string(y.factor) +
        " differs from max_position_embeddings / "
        "original_max_position_embeddings (transformers versions disagree on which applies)");
  y.beta_fast = number("beta_fast", 32.0);
  y.beta_slow = number("beta_slow", 1.0);
  if (y.beta_fast == 0) y.beta_fast = 32.0;  // transformers: `or 32`
  if (y.beta_slow == 0) y.beta_slow = 1.0;
  if (rs.contains("truncate")) {
    if (!rs["truncate"].is_boolean())
      throw Error(path + ": rope_scaling.truncate must be a boolean");
    y.truncate = rs["truncate"].get<bool>();
  }
  auto mscale_of = [](double scale, double m) {
    return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  };
  const double mscale = number("mscale", 0), mscale_all_dim = number("mscale_all_dim", 0);
  if (rs.contains("attention_factor") && !rs["attention_factor"].is_null())
    y.attention_factor = number("attention_factor", 1.0);
  else if (mscale != 0 && mscale_all_dim != 0)
    y.attention_factor = mscale_of(y.factor, mscale) / mscale_of(y.factor, mscale_all_dim);
  else
    y.attention_factor = mscale_of(y.factor, 1.0);
  // DeepseekV3Attention: softmax scale times mscale(factor, mscale_all_dim)^2.
  if (mscale_all_dim != 0) y.softmax_mscale = std::pow(mscale_of(y.factor, mscale_all_dim), 2);
  return y;
}

// Upper bounds that keep every derived size far from overflow and from exhausting memory before
// an error can be given. They are well above every released MoE model.
constexpr int kMaxVocab = 1 << 22, kMaxHidden = 1 << 16, kMaxLayers = 1 << 10, kMaxHeads = 1 << 10,
              kMaxHeadDim = 1 << 11, kMaxExperts = 32767, kMaxIntermediate = 1 << 18,
              kMaxPositions = 1 << 24;

void require_range(const std::string& path, const char* key, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    throw Error(path + ": key \"" + key + "\" is " + std::to_string(v) + ", outside [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

// quantization_config: GPT-OSS's MXFP4 experts, or block-scaled FP8 weights (DeepSeek-V3,
// Kimi-K2, Qwen3 FP8: transformers' FineGrainedFP8Config). Anything else is refused by name.
// r3 computes FP8 weights as the bf16 values transformers' dequantization gives (weights only:
// activations stay bf16), so "dynamic" activation scaling is what it replaces; static
// activation scales would need input_scale tensors r3 does not read.
void parse_quantization(const json& j, ModelConfig& c, const std::string& path) {
  if (!j.contains("quantization_config") || j["quantization_config"].is_null()) return;
  const json& q = j["quantization_config"];
  const std::string what = path + ": key \"quantization_config\" = " + q.dump();
  const json method = q.is_object() ? q.value("quant_method", json()) : json();
  if (c.arch == Arch::GptOss) {
    if (method != "mxfp4")
      throw Error(what + " is not implemented by r3 (GPT-OSS: quant_method \"mxfp4\" only)");
    c.experts_mxfp4 = true;
    return;
  }
  if (method != "fp8")
    throw Error(what +
                " is not implemented by r3 (quant_method \"fp8\" with weight_block_size; GPT-OSS: "
                "\"mxfp4\")");
  if (q.contains("fmt") && q["fmt"] != "e4m3")
    throw Error(what + " is not implemented by r3 (fmt \"e4m3\" only)");
  if (q.contains("activation_scheme") && q["activation_scheme"] != "dynamic")
    throw Error(what +
                " is not implemented by r3 (activation_scheme \"dynamic\" only: static input "
                "scales are not read)");
  c.fp8_block_rows = c.fp8_block_cols = 128;  // FineGrainedFP8Config's default
  if (q.contains("weight_block_size") && !q["weight_block_size"].is_null()) {
    const json& b = q["weight_block_size"];
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer())
      throw Error(what + ": weight_block_size must be [rows, cols]");
    c.fp8_block_rows = b[0].get<int>();
    c.fp8_block_cols = b[1].get<int>();
  }
  // Even columns: an input pair (how the kernels read weights) never straddles two blocks.
  if (c.fp8_block_rows < 1 || c.fp8_block_rows > (1 << 16) || c.fp8_block_cols < 2 ||
      c.fp8_block_cols > (1 << 16) || c.fp8_block_cols % 2)
    throw Error(what + ": weight_block_size must be [1..65536, an even 2..65536]");
}

// Qwen-style MoE placement: layer i has routed experts unless it is in mlp_only_layers, when the
// model has experts and (i + 1) is a multiple of decoder_sparse_step.
std::vector<bool> moe_layers_of(const Reader& r, const ModelConfig& c, const std::string& path) {
  const json& j = r.j;
  const int step = r.opt_int("decoder_sparse_step", 1);
  if (step <= 0) throw Error(path + ": decoder_sparse_step must be positive");
  std::vector<bool> moe(size_t(c.num_layers));
  std::vector<int> mlp_only;
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    if (!j["mlp_only_layers"].is_array()) throw Error(path + ": mlp_only_layers must be a list");
    for (auto& v : j["mlp_only_layers"]) {
      if (!fits_int(v)) throw Error(path + ": mlp_only_layers must hold integers");
      const int layer = v.get<int>();
      if (layer < 0 || layer >= c.num_layers)
        throw Error(path + ": mlp_only_layers names layer " + std::to_string(layer) +
                    " of a model with " + std::to_string(c.num_layers));
      mlp_only.push_back(layer);
    }
  }
  for (int i = 0; i < c.num_layers; ++i) {
    const bool only = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end();
    moe[size_t(i)] = !only && c.num_experts > 0 && (i + 1) % step == 0;
  }
  return moe;
}

}  // namespace

ModelConfig parse_config(const std::string& text, const std::string& path) {
  json j;
  try {
    j = parse_json_bounded(text, path, 16);
  } catch (const json::exception& e) {
    throw Error(path + ": malformed JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(path + ": not a JSON object");
  Reader r{j, path};
  ModelConfig c;
  AttentionSpec attn;  // every layer's, in these families
  std::string arch;
  if (j.contains("architectures") && j["architectures"].is_array() &&
      j["architectures"].size() == 1 && j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  else
    throw Error(path + ": \"architectures\" must be a list naming one model class");
  c.architecture = arch;
  const Family* family = family_of_hf_class(arch);
  if (!family)
    throw Error(path + ": unknown architecture \"" + arch + "\" (r3 supports " +
                supported_hf_classes() + ")");
  c.arch = family->arch;
  if (arch == "Qwen3_5MoeForConditionalGeneration") {
    // The vision-language release: the decoder's config is text_config and its tensors live under
    // model.language_model.; the vision tower (vision_config, model.visual.*) is not read, and
    // image inputs are refused. Top-level keys the decoder reads (tie_word_embeddings, token
    // ids) apply where text_config does not set them.
    if (!j.contains("text_config") || !j["text_config"].is_object())
      throw Error(path + ": " + arch + " needs a \"text_config\" object (the decoder's config)");
    json text = j["text_config"];
    for (const char* key :
         {"tie_word_embeddings", "eos_token_id", "bos_token_id", "quantization_config"})
      if (j.contains(key) && !text.contains(key)) text[key] = j[key];
    c.vision_tower = j.contains("vision_config") && !j["vision_config"].is_null();
    c.tensor_prefix = "model.language_model.";
    j = std::move(text);
  }

  for (const char* key : kUnimplemented)
    if (!reads_key(c.arch, key) && j.contains(key) && !j[key].is_null() && j[key] != false &&
        j[key] != 0 &&
        !(j[key].is_number() && j[key].get<double>() == 1.0 &&
          (std::string(key) == "partial_rotary_factor" || std::string(key) == "pretraining_tp")))
      throw Error(path + ": key \"" + key + "\" = " + j[key].dump() + " is not implemented by r3");

  c.vocab_size = r.req_int("vocab_size");
  c.hidden_size = r.req_int("hidden_size");
  c.num_layers = r.req_int("num_hidden_layers");
  c.num_heads = r.req_int("num_attention_heads");
  c.num_kv_heads = r.opt_int("num_key_value_heads", c.num_heads);
  c.head_dim = r.opt_int("head_dim", c.hidden_size / c.num_heads);
  c.top_k = r.req_int("num_experts_per_tok");
  c.rope_theta = r.opt_float("rope_theta", c.arch == Arch::Mixtral ? 1e6f : 10000.f);
  c.rms_norm_eps = r.opt_float("rms_norm_eps",
                               c.arch == Arch::Mixtral || c.arch == Arch::Glm4Moe ? 1e-5f : 1e-6f);
  if (c.arch == Arch::DeepseekV3) {
    // MLA: head_dim is the query/key head width (nope + rope); there are no kv heads as such.
    MlaSpec m;
    m.q_lora_rank = r.opt_int("q_lora_rank", 0);
    m.kv_lora_rank = r.req_int("kv_lora_rank");
    m.qk_nope_head_dim = r.req_int("qk_nope_head_dim");
    m.qk_rope_head_dim = r.req_int("qk_rope_head_dim");
    m.v_head_dim = r.req_int("v_head_dim");
    require_range(path, "q_lora_rank", m.q_lora_rank, 0, kMaxHidden);
    require_range(path, "kv_lora_rank", m.kv_lora_rank, 2, kMaxHidden);
    require_range(path, "qk_nope_head_dim", m.qk_nope_head_dim, 2, kMaxHeadDim);
    require_range(path, "qk_rope_head_dim", m.qk_rope_head_dim, 2, kMaxHeadDim);
    require_range(path, "v_head_dim", m.v_head_dim, 2, kMaxHeadDim);
    if (m.qk_rope_head_dim % 2 || m.kv_lora_rank % 2 || m.qk_nope_head_dim % 2 || m.v_head_dim % 2)
      throw Error(path +
                  ": MLA head sizes (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) "
                  "must be even");
    c.mla = m;
    c.head_dim = m.qk_head_dim();
    c.num_kv_heads = c.num_heads;
    // transformers' DeepseekV3Config: rope_interleave (default true) rotates adjacent pairs.
    attn.rope_interleaved = r.opt_bool("rope_interleave", true);
  }
  c.tie_word_embeddings = r.opt_bool("tie_word_embeddings", false);
  c.max_position_embeddings = r.opt_int("max_position_embeddings", 4096);
  c.eos_token_id = r.token_id("eos_token_id");
  c.bos_token_id = r.token_id("bos_token_id");
  require_range(path, "vocab_size", c.vocab_size, 1, kMaxVocab);
  require_range(path, "hidden_size", c.hidden_size, 1, kMaxHidden);
  require_range(path, "num_hidden_layers", c.num_layers, 1, kMaxLayers);
  require_range(path, "num_attention_heads", c.num_heads, 1, kMaxHeads);
  require_range(path, "num_key_value_heads", c.num_kv_heads, 1, c.num_heads);
  require_range(path, "head_dim", c.head_dim, 2, kMaxHeadDim);
  require_range(path, "max_position_embeddings", c.max_position_embeddings, 2, kMaxPositions);
  if (c.num_heads % c.num_kv_heads != 0)
    throw Error(path + ": num_attention_heads must be a multiple of num_key_value_heads");
  if (c.head_dim % 2) throw Error(path + ": head_dim must be even");
  // NaN fails every comparison, so these are written to reject it too.
  if (!(c.rope_theta > 1.f && c.rope_theta < 1e12f))
    throw Error(path + ": key \"rope_theta\" must be a finite number above 1");
  if (!(c.rms_norm_eps > 0.f && c.rms_norm_eps < 1.f))
    throw Error(path + ": key \"rms_norm_eps\" must be in (0, 1)");
  for (int id : {c.eos_token_id, c.bos_token_id})
    if (id < -1 || id >= c.vocab_size)
      throw Error(path + ": eos_token_id / bos_token_id " + std::to_string(id) +
                  " is outside the vocabulary");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    throw Error(path + ": key \"hidden_act\" = " + j["hidden_act"].dump() +
                " is not implemented by r3 (only \"silu\")");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    const bool neutral = rs.is_object() && rs.size() <= 2 &&
                         ((rs.contains("rope_type") && rs["rope_type"] == "default") ||
                          (rs.contains("type") && rs["type"] == "default"));
    if (rs.is_object() && rs.contains("type") && rs.contains("rope_type") &&
        rs["type"] != rs["rope_type"])
      throw Error(path + ": key \"rope_scaling\" has type " + rs["type"].dump() +
                  " and rope_type " + rs["rope_type"].dump() +
                  " (transformers lets type win; give one)");
    const bool yarn = rs.is_object() && ((rs.contains("rope_type") && rs["rope_type"] == "yarn") ||
                                         (rs.contains("type") && rs["type"] == "yarn"));
    if (yarn) {
      c.rope_scaling = parse_yarn(rs, c.max_position_embeddings, path);
    } else if (!neutral) {
      throw Error(path + ": key \"rope_scaling\" = " + rs.dump() +
                  " is not implemented by r3 (default or yarn)");
    }
  }
  // q/k/v biases: Qwen2-MoE always has them (qkv_bias in newer configs), GLM-4.5 per
  // attention_bias; o_proj never. Elsewhere attention_bias = true is refused.
  if (c.arch == Arch::Qwen2Moe)
    attn.qkv_bias = r.opt_bool("qkv_bias", true);
  else if (c.arch == Arch::Glm4Moe)
    attn.qkv_bias = r.opt_bool("attention_bias", false);
  else if (c.arch == Arch::GptOss)
    attn.qkv_bias = attn.o_bias = r.opt_bool("attention_bias", true);
  else if (r.opt_bool("attention_bias", false))
    throw Error(path + ": key \"attention_bias\" = true is not implemented by r3 for " + arch +
                " (no q/k/v/o biases)");
  attn.rotary_dim = c.mla ? c.mla->qk_rope_head_dim : c.head_dim;
  // A sliding window at least as long as the context changes nothing; a shorter one would.
  const bool window_used = c.arch != Arch::GptOss &&
                           (c.arch == Arch::Mixtral || r.opt_bool("use_sliding_window", false));
  if (window_used && j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    const int w = r.opt_int("sliding_window", 0);
    if (w < c.max_position_embeddings)
      throw Error(path + ": key \"sliding_window\" = " + std::to_string(w) +
                  " is not implemented by r3 (sliding-window attention)");
  }

  std::vector<bool> moe(size_t(c.num_layers), true);  // per decoder layer: routed experts or dense
  std::vector<int> window(size_t(c.num_layers), 0);   // per decoder layer: sliding window or 0
  std::vector<bool> linear(size_t(c.num_layers), false);  // per decoder layer: Gated DeltaNet
  ExpertActivation activation;
  bool expert_bias = false;
  int shared = 0;  // shared-expert MLP size of every MoE layer
  bool shared_gate = false;
  switch (c.arch) {
    case Arch::Mixtral:
      c.num_experts = r.req_int("num_local_experts");
      c.moe_intermediate_size = r.req_int("intermediate_size");
      c.norm_topk_prob = true;
      attn.qk_norm = QkNorm::None;
      break;
    case Arch::Qwen3Moe:
    case Arch::Qwen2Moe: {
      c.num_experts = r.opt_int("num_experts", 0);
      c.moe_intermediate_size = r.req_int("moe_intermediate_size");
      c.intermediate_size = r.opt_int("intermediate_size", 0);
      c.norm_topk_prob = r.opt_bool("norm_topk_prob", false);
      attn.qk_norm = c.arch == Arch::Qwen3Moe ? QkNorm::PerHead : QkNorm::None;
      moe = moe_layers_of(r, c, path);
      if (c.arch == Arch::Qwen2Moe) {
        // One shared expert behind a sigmoid gate on every MoE layer (Qwen2MoeSparseMoeBlock).
        shared = r.opt_int("shared_expert_intermediate_size", 0);
        if (shared < 0)
          throw Error(path + ": shared_expert_intermediate_size must not be negative");
        shared_gate = shared > 0;
      }
      break;
    }
    case Arch::DeepseekV3:
    case Arch::Glm4Moe: {
      // Glm4MoeConfig and DeepseekV3Config: sigmoid router with a selection bias and group-limited
      // choice (the DeepSeek-V3 router), n_shared_experts fused into one MLP, dense first layers,
      // partial rotary, optional per-head q/k norm.
      c.num_experts =
          r.req_int(j.contains("n_routed_experts") ? "n_routed_experts" : "num_experts");
      c.moe_intermediate_size = r.req_int("moe_intermediate_size");
      c.intermediate_size = r.req_int("intermediate_size");
      c.norm_topk_prob = r.opt_bool("norm_topk_prob", true);
      attn.qk_norm = r.opt_bool("use_qk_norm", false) ? QkNorm::PerHead : QkNorm::None;
      if (c.arch == Arch::DeepseekV3) {
        // Only the router DeepSeek-V3 released with (sigmoid scores, noaux_tc selection).
        if (j.contains("scoring_func") && j["scoring_func"] != "sigmoid")
          throw Error(path + ": key \"scoring_func\" = " + j["scoring_func"].dump() +
                      " is not implemented by r3");
        if (j.contains("topk_method") && j["topk_method"] != "noaux_tc")
          throw Error(path + ": key \"topk_method\" = " + j["topk_method"].dump() +
                      " is not implemented by r3");
      }
      c.router.scoring = RouterScoring::Sigmoid;
      c.router.selection_bias = true;
      // Required rather than defaulted: transformers' defaults for these differ by family and
      // version (DeepseekV3Config: n_group 8, topk_group 4, routed_scaling_factor 2.5), and a wrong
      // default silently changes every choice or gate weight. Released configs state them.
      for (const char* key : {"n_group", "topk_group", "routed_scaling_factor"})
        if (!j.contains(key) || j[key].is_null())
          throw Error(path + ": missing key \"" + key + "\" (required for " + arch + ")");
      c.router.n_group = r.req_int("n_group");
      c.router.topk_group = r.req_int("topk_group");
      c.router.routed_scaling_factor = r.opt_float("routed_scaling_factor", 1.f);
      const int n_shared = r.opt_int("n_shared_experts", 0);
      require_range(path, "n_shared_experts", n_shared, 0, 64);
      shared = n_shared * c.moe_intermediate_size;
      const int dense = r.opt_int("first_k_dense_replace", 0);
      require_range(path, "first_k_dense_replace", dense, 0, c.num_layers);
      for (int i = 0; i < c.num_layers; ++i) moe[size_t(i)] = i >= dense;
      c.num_nextn_predict_layers = r.opt_int("num_nextn_predict_layers", 0);
      require_range(path, "num_nextn_predict_layers", c.num_nextn_predict_layers, 0, 16);
      // Glm4MoeConfig's default is 0.5; a config without the key gets it, as in transformers.
      const float partial =
          c.arch == Arch::Glm4Moe ? r.opt_float("partial_rotary_factor", 0.5f) : 1.f;
      if (!(partial > 0.f && partial <= 1.f))
        throw Error(path + ": key \"partial_rotary_factor\" must be in (0, 1]");
      if (c.arch == Arch::Glm4Moe) attn.rotary_dim = int(float(c.head_dim) * partial);
      if (attn.rotary_dim < 2 || attn.rotary_dim % 2)
        throw Error(path + ": partial_rotary_factor gives an odd or empty rotary dimension " +
                    std::to_string(attn.rotary_dim) + " of head_dim " + std::to_string(c.head_dim));
      if (!(c.router.routed_scaling_factor > 0.f && c.router.routed_scaling_factor < 1e6f))
        throw Error(path + ": key \"routed_scaling_factor\" must be a positive finite number");
      break;
    }
    case Arch::GptOss: {
      // GptOssConfig: every layer MoE with biased experts and the clamped SwiGLU, a router with
      // a logit bias (top-k of the logits, softmax over the k), attention with q/k/v/o biases and
      // per-head sinks, layer_types alternating sliding and full attention (sliding first).
      c.num_experts = r.req_int("num_local_experts");
      c.moe_intermediate_size = r.req_int("intermediate_size");
      c.norm_topk_prob = false;
      c.router.scoring = RouterScoring::TopkSoftmax;
      c.router.logit_bias = true;
      attn.sinks = true;
      expert_bias = true;
      activation.clamped = true;
      activation.limit = r.opt_float("swiglu_limit", 7.f);
      if (!(activation.limit > 0.f && activation.limit < 1e30f))
        throw Error(path + ": key \"swiglu_limit\" must be a positive finite number");
      const int w = r.opt_int("sliding_window", 128);
      require_range(path, "sliding_window", w, 1, kMaxPositions);
      std::vector<std::string> types;
      if (j.contains("layer_types") && !j["layer_types"].is_null()) {
        if (!j["layer_types"].is_array() || int(j["layer_types"].size()) != c.num_layers)
          throw Error(path + ": layer_types must be a list of num_hidden_layers entries");
        for (auto& t : j["layer_types"]) {
          if (t != "sliding_attention" && t != "full_attention")
            throw Error(path + ": layer_types entry " + t.dump() +
                        " is not implemented by r3 "
                        "(sliding_attention or full_attention)");
          types.push_back(t.get<std::string>());
        }
      } else {
        for (int i = 0; i < c.num_layers; ++i)
          types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
      }
      for (int i = 0; i < c.num_layers; ++i)
        window[size_t(i)] = types[size_t(i)] == "sliding_attention" ? w : 0;
      break;
    }
    case Arch::Qwen3Next:
    case Arch::Qwen3_5Moe: {
      // Qwen3NextConfig and Qwen3_5MoeTextConfig: Gated DeltaNet layers, with gated full attention
      // on every full_attention_interval-th layer (layer_types), routed experts beside one shared
      // expert behind a sigmoid gate, zero-centred norms, per-head q/k norm, partial rotary.
      c.num_experts = r.req_int("num_experts");
      c.moe_intermediate_size = r.req_int("moe_intermediate_size");
      c.intermediate_size = r.opt_int("intermediate_size", 0);
      // Qwen3.5's sparse block always renormalises the top-k (its config has no such key).
      c.norm_topk_prob = c.arch == Arch::Qwen3_5Moe || r.opt_bool("norm_topk_prob", true);
      attn.qk_norm = QkNorm::PerHead;
      attn.output_gate = true;
      c.zero_centred_norms = true;
      shared = r.opt_int("shared_expert_intermediate_size", 0);
      if (shared < 0) throw Error(path + ": shared_expert_intermediate_size must not be negative");
      shared_gate = shared > 0;
      DeltaNetSpec d;
      d.k_heads = r.req_int("linear_num_key_heads");
      d.v_heads = r.req_int("linear_num_value_heads");
      d.k_head_dim = r.req_int("linear_key_head_dim");
      d.v_head_dim = r.req_int("linear_value_head_dim");
      d.conv_kernel = r.opt_int("linear_conv_kernel_dim", 4);
      d.combined_projections = c.arch == Arch::Qwen3Next;
      require_range(path, "linear_num_key_heads", d.k_heads, 1, kMaxHeads);
      require_range(path, "linear_num_value_heads", d.v_heads, d.k_heads, kMaxHeads);
      require_range(path, "linear_key_head_dim", d.k_head_dim, 1, kMaxHeadDim);
      require_range(path, "linear_value_head_dim", d.v_head_dim, 1, kMaxHeadDim);
      require_range(path, "linear_conv_kernel_dim", d.conv_kernel, 1, 64);
      if (d.v_heads % d.k_heads)
        throw Error(path + ": linear_num_value_heads must be a multiple of linear_num_key_heads");
      c.deltanet = d;
      moe = moe_layers_of(r, c, path);
      // Rotary: rope_parameters (newer configs: rope_theta, partial_rotary_factor, and Qwen3.5's
      // multimodal sections, which for text, where every section's position is the token's,
      // rotate exactly as plain RoPE) or the top-level keys.
      float partial = r.opt_float("partial_rotary_factor", 0.25f);
      if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
        const json& rp = j["rope_parameters"];
        if (!rp.is_object()) throw Error(path + ": rope_parameters must be an object");
        for (auto it = rp.begin(); it != rp.end(); ++it) {
          const std::string& key = it.key();
          if (key == "rope_type" || key == "type") {
            if (it.value() != "default")
              throw Error(path + ": rope_parameters." + key + " = " + it.value().dump() +
                          " is not implemented by r3 (default)");
          } else if (key == "rope_theta" || key == "partial_rotary_factor") {
            if (!it.value().is_number())
              throw Error(path + ": rope_parameters." + key + " must be a number");
            (key == "rope_theta" ? c.rope_theta : partial) = it.value().get<float>();
          } else if (key != "mrope_section" && key != "mrope_interleaved") {
            throw Error(path + ": rope_parameters holds \"" + key +
                        "\", which is not implemented by r3");
          }
        }
        if (!(c.rope_theta > 1.f && c.rope_theta < 1e12f))
          throw Error(path + ": rope_parameters.rope_theta must be a finite number above 1");
      }
      if (!(partial > 0.f && partial <= 1.f))
        throw Error(path + ": partial_rotary_factor must be in (0, 1]");
      attn.rotary_dim = int(float(c.head_dim) * partial);
      if (attn.rotary_dim < 2 || attn.rotary_dim % 2)
        throw Error(path + ": partial_rotary_factor gives an odd or empty rotary dimension " +
                    std::to_string(attn.rotary_dim) + " of head_dim " + std::to_string(c.head_dim));
      const int interval = r.opt_int("full_attention_interval", 4);
      require_range(path, "full_attention_interval", interval, 1, kMaxLayers);
      if (j.contains("layer_types") && !j["layer_types"].is_null()) {
        if (!j["layer_types"].is_array() || int(j["layer_types"].size()) != c.num_layers)
          throw Error(path + ": layer_types must be a list of num_hidden_layers entries");
        for (int i = 0; i < c.num_layers; ++i) {
          const json& t = j["layer_types"][size_t(i)];
          if (t != "linear_attention" && t != "full_attention")
            throw Error(path + ": layer_types entry " + t.dump() +
                        " is not implemented by r3 "
                        "(linear_attention or full_attention)");
          linear[size_t(i)] = t == "linear_attention";
        }
      } else {
        for (int i = 0; i < c.num_layers; ++i) linear[size_t(i)] = (i + 1) % interval != 0;
      }
      c.num_mtp_layers = r.opt_int(
          c.arch == Arch::Qwen3Next ? "num_nextn_predict_layers" : "mtp_num_hidden_layers", 0);
      require_range(path, "MTP layers", c.num_mtp_layers, 0, 16);
      break;
    }
    case Arch::Olmoe:
      c.num_experts = r.req_int("num_experts");
      c.moe_intermediate_size = r.req_int("intermediate_size");
      c.norm_topk_prob = r.opt_bool("norm_topk_prob", false);
      attn.qk_norm = QkNorm::Whole;
      if (j.contains("clip_qkv") && !j["clip_qkv"].is_null()) {
        if (!j["clip_qkv"].is_number()) throw Error(path + ": clip_qkv must be a number or null");
        attn.clip_qkv = j["clip_qkv"].get<float>();
        if (!(*attn.clip_qkv > 0.f && *attn.clip_qkv < 1e30f))
          throw Error(path + ": key \"clip_qkv\" must be a positive finite number");
      }
      break;
  }
  require_range(
      path, c.arch == Arch::Mixtral || c.arch == Arch::GptOss ? "num_local_experts" : "num_experts",
      c.num_experts, 0, kMaxExperts);
  const bool moe_key = c.arch != Arch::Mixtral && c.arch != Arch::Olmoe && c.arch != Arch::GptOss;
  require_range(path, moe_key ? "moe_intermediate_size" : "intermediate_size",
                c.moe_intermediate_size, 1, kMaxIntermediate);
  if (c.intermediate_size)
    require_range(path, "intermediate_size", c.intermediate_size, 1, kMaxIntermediate);
  if (shared) require_range(path, "shared expert intermediate size", shared, 1, kMaxIntermediate);
  parse_quantization(j, c, path);
  if (c.deltanet && (c.fp8_block_rows || c.experts_mxfp4))
    throw Error(path + ": quantization_config is not implemented by r3 for " + arch +
                " (bf16 or f32 weights only)");
  if (c.experts_mxfp4 && (c.hidden_size % 32 || c.moe_intermediate_size % 32))
    throw Error(
        path +
        ": MXFP4 experts need hidden_size and intermediate_size divisible by 32 (the block size)");
  if (c.num_experts > 0 && c.top_k > c.num_experts)
    throw Error(path + ": num_experts_per_tok exceeds the number of experts");
  if (std::count(moe.begin(), moe.end(), true) == 0)
    throw Error(path + ": the model has no MoE layer");
  for (int i = 0; i < c.num_layers; ++i)
    if (!moe[size_t(i)] && c.intermediate_size <= 0)
      throw Error(path + ": layer " + std::to_string(i) +
                  " is dense but \"intermediate_size\" is missing");
  c.router.renormalize = c.norm_topk_prob;
  const RouterSpec& rs = c.router;
  if (rs.n_group < 1 || rs.topk_group < 1 || rs.topk_group > rs.n_group ||
      c.num_experts % rs.n_group != 0)
    throw Error(path + ": n_group " + std::to_string(rs.n_group) + " / topk_group " +
                std::to_string(rs.topk_group) + " must divide the " +
                std::to_string(c.num_experts) + " experts into groups, keeping 1..n_group");
  if (rs.n_group > 1 &&
      (c.num_experts / rs.n_group < 2 || c.top_k > rs.topk_group * (c.num_experts / rs.n_group)))
    throw Error(
        path +
        ": group-limited routing needs at least 2 experts per group and num_experts_per_tok <= "
        "topk_group x experts per group");
  for (int i = 0; i < c.num_layers; ++i) {
    LayerConfig l;
    l.attention = attn;
    l.attention.kind = c.mla               ? AttentionKind::Mla
                       : linear[size_t(i)] ? AttentionKind::GatedDeltaNet
                                           : AttentionKind::Gqa;
    if (linear[size_t(i)])
      l.attention.qk_norm = QkNorm::None, l.attention.output_gate = false;  // GQA's only
    l.moe = moe[size_t(i)];
    l.intermediate = l.moe ? c.moe_intermediate_size : c.intermediate_size;
    l.shared_intermediate = l.moe ? shared : 0;
    l.shared_gate = l.moe && shared_gate;
    l.attention.sliding_window = window[size_t(i)];
    l.expert_bias = l.moe && expert_bias;
    l.activation = activation;
    c.layers.push_back(l);
  }
  return c;
}

namespace {
// Every field of c as name -> its value printed with every digit (a refit must not pass because
// two values print alike).
std::vector<std::pair<std::string, std::string>> printed_fields(const ModelConfig& c) {
  std::vector<std::pair<std::string, std::string>> out;
  visit_fields(c, [&](const std::string& name, const auto& value) {
    using T = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<T, std::nullopt_t>) {
      out.emplace_back(name, "none");
    } else if constexpr (std::is_same_v<T, std::string>) {
      out.emplace_back(name, value);
    } else if constexpr (std::is_same_v<T, bool>) {
      out.emplace_back(name, value ? "true" : "false");
    } else if constexpr (std::is_enum_v<T>) {
      out.emplace_back(name, std::to_string(int(value)));
    } else {
      std::ostringstream o;
      o.precision(17);
      o << value;
      out.emplace_back(name, o.str());
    }
  });
  return out;
}

// Fields of weights r3 never runs: a trainer's checkpoint may leave them out (NeMo-RL strips the
// MTP layers), and a refit then changes nothing r3 computes.
bool never_run(const std::string& name) {
  return name == "num_mtp_layers" || name == "num_nextn_predict_layers";
}

}  // namespace

std::vector<std::string> config_differences(const ModelConfig& a, const ModelConfig& b) {
  constexpr size_t kShown = 16;
  auto fa = printed_fields(a), fb = printed_fields(b);
  for (auto* f : {&fa, &fb})
    std::erase_if(*f,
                  [](const std::pair<std::string, std::string>& p) { return never_run(p.first); });
  std::map<std::string, std::string> in_b(fb.begin(), fb.end());
  std::vector<std::string> out;
  size_t differ = 0;
  auto note = [&](const std::string& line) {
    if (++differ <= kShown) out.push_back(line);
  };
  for (const auto& [name, value] : fa) {
    auto it = in_b.find(name);
    const std::string other = it == in_b.end() ? "absent" : it->second;
    if (other != value) note(name + ": " + value + " -> " + other);
    if (it != in_b.end()) in_b.erase(it);
  }
  for (const auto& [name, value] : fb)  // in b only (more layers, an optional part present)
    if (in_b.count(name)) note(name + ": absent -> " + value);
  if (differ > kShown) out.push_back("... and " + std::to_string(differ - kShown) + " more");
  return out;
}

ModelConfig load_config(const std::string& path) {
  return parse_config(read_text_file(path, 16u << 20, "config.json"), path);
}

}  // namespace r3
