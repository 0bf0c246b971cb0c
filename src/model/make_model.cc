#include "model/make_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "model/checkpoint.h"
#include "model/families.h"
#include "model/safetensors.h"
#include "model/tensor_names.h"
#include "text/tokenizer.h"

namespace r3 {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct Preset {
  int layers, hidden, heads, kv_heads, head_dim, experts, top_k, moe_inter, dense_inter, vocab;
  int shards;
};

bool hybrid_arch(const std::string& arch) {
  return arch == "qwen3_next" || arch == "qwen3_5_moe" || arch == "qwen3_5_moe_text";
}

// The Gated DeltaNet sizes of a hybrid preset: key heads, value heads, key dim, value dim.
std::array<int, 4> deltanet_sizes(const std::string& preset) {
  if (preset == "tiny") return {2, 4, 16, 16};
  if (preset == "small") return {4, 8, 32, 32};
  return {8, 16, 64, 64};  // bench
}

Preset get_preset(const std::string& arch, const std::string& preset) {
  // Hybrids: four layers at least, so the default full_attention_interval 4 gives three DeltaNet
  // layers and one gated full-attention layer; the bench preset has 256 experts.
  if (hybrid_arch(arch)) {
    if (preset == "tiny") return {4, 64, 4, 2, 16, 8, 2, 32, 96, 512, 1};
    if (preset == "small") return {4, 256, 8, 2, 32, 32, 8, 64, 512, 2048, 2};
    if (preset == "bench") return {12, 1024, 16, 2, 64, 256, 8, 128, 2048, 32000, 6};
  }
  if (preset == "tiny") return {2, 64, 4, 2, 16, 8, 2, 32, 96, 512, 1};
  if (preset == "small") {
    if (arch == "mixtral") return {4, 256, 8, 2, 32, 16, 4, 128, 512, 2048, 2};
    if (arch == "qwen3_moe" || arch == "qwen2_moe")
      return {4, 256, 8, 4, 32, 32, 8, 64, 512, 2048, 2};
    if (arch == "glm4_moe" || arch == "deepseek_v3")
      return {4, 256, 8, 2, 32, 16, 4, 64, 512, 2048, 2};
    if (arch == "gpt_oss") return {4, 256, 8, 2, 64, 16, 4, 128, 512, 2048, 2};
    return {4, 256, 8, 8, 32, 64, 8, 64, 512, 2048, 2};
  }
  if (preset == "bench") return {12, 1024, 16, 16, 64, 64, 8, 512, 2048, 32000, 6};
  // The released models' shapes, one shard per layer (make-model holds one layer at a time).
  if (preset == "full") {
    if (arch == "olmoe")
      return {16, 2048, 16, 16, 128, 64, 8, 1024, 1024, 50304, 18};  // OLMoE-1B-7B-0924
    if (arch == "qwen3_moe")
      return {48, 2048, 32, 4, 128, 128, 8, 768, 6144, 151936, 50};  // Qwen3-30B-A3B
    if (arch == "gpt_oss")
      return {24, 2880, 64, 8, 64, 32, 4, 2880, 2880, 201088, 26};  // gpt-oss-20b
    throw Error(
        "--preset full exists for olmoe, qwen3_moe and gpt_oss (the shapes of OLMoE-1B-7B-0924, "
        "Qwen3-30B-A3B and gpt-oss-20b), not " +
        arch);
  }
  throw Error("unknown preset \"" + preset + "\" (tiny, small, bench, full)");
}

}  // namespace

std::string preset_config_json(const std::string& arch, const std::string& preset) {
  Preset p = get_preset(arch, preset);
  json j;
  j["vocab_size"] = p.vocab;
  j["hidden_size"] = p.hidden;
  j["num_hidden_layers"] = p.layers;
  j["num_attention_heads"] = p.heads;
  j["num_key_value_heads"] = p.kv_heads;
  j["num_experts_per_tok"] = p.top_k;
  const bool full = preset == "full";
  j["max_position_embeddings"] = 4096;
  j["rms_norm_eps"] = 1e-6;
  j["bos_token_id"] = 1;
  j["eos_token_id"] = 2;
  j["torch_dtype"] = "bfloat16";
  if (arch == "mixtral") {
    j["architectures"] = {"MixtralForCausalLM"};
    j["model_type"] = "mixtral";
    j["num_local_experts"] = p.experts;
    j["intermediate_size"] = p.moe_inter;
    j["rope_theta"] = 1e6;
    j["tie_word_embeddings"] = false;
    j["hidden_act"] = "silu";
  } else if (arch == "qwen3_moe") {
    j["architectures"] = {"Qwen3MoeForCausalLM"};
    j["model_type"] = "qwen3_moe";
    j["num_experts"] = p.experts;
    j["moe_intermediate_size"] = p.moe_inter;
    j["intermediate_size"] = p.dense_inter;
    j["head_dim"] = p.head_dim;
    j["norm_topk_prob"] = true;
    j["decoder_sparse_step"] = 1;
    // tiny and full (Qwen3-30B-A3B) keep every layer MoE; small and bench have a dense first layer.
    j["mlp_only_layers"] = preset == "tiny" || full ? json::array() : json::array({0});
    j["rope_theta"] = 1e6;
    j["tie_word_embeddings"] = preset == "tiny";
    if (full) j["max_position_embeddings"] = 40960;
    j["hidden_act"] = "silu";
  } else if (arch == "olmoe") {
    j["architectures"] = {"OlmoeForCausalLM"};
    j["model_type"] = "olmoe";
    j["num_experts"] = p.experts;
    j["intermediate_size"] = p.moe_inter;
    j["norm_topk_prob"] = false;
    j["clip_qkv"] = preset == "tiny" ? json(8.0) : json(nullptr);
    j["rope_theta"] = 10000.0;
    j["tie_word_embeddings"] = false;
    j["hidden_act"] = "silu";
    if (full) j["rms_norm_eps"] = 1e-5;
  } else if (arch == "qwen2_moe") {
    // Qwen1.5-MoE's layout: q/k/v biases, softmax router without renormalisation, one shared
    // expert behind a sigmoid gate.
    j["architectures"] = {"Qwen2MoeForCausalLM"};
    j["model_type"] = "qwen2_moe";
    j["num_experts"] = p.experts;
    j["moe_intermediate_size"] = p.moe_inter;
    j["shared_expert_intermediate_size"] = 2 * p.moe_inter;
    j["intermediate_size"] = p.dense_inter;
    j["norm_topk_prob"] = false;
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = preset == "tiny" ? json::array() : json::array({0});
    j["rope_theta"] = 1e6;
    j["tie_word_embeddings"] = false;
    j["hidden_act"] = "silu";
  } else if (arch == "glm4_moe") {
    // GLM-4.5's layout: sigmoid router with e_score_correction_bias and group-limited choice,
    // routed scaling, a shared expert, a dense first layer, partial rotary, q/k/v biases; the
    // small preset adds per-head q/k norm and one MTP layer (stored, not run).
    j["architectures"] = {"Glm4MoeForCausalLM"};
    j["model_type"] = "glm4_moe";
    j["n_routed_experts"] = p.experts;
    j["n_shared_experts"] = 1;
    j["moe_intermediate_size"] = p.moe_inter;
    j["intermediate_size"] = p.dense_inter;
    j["n_group"] = preset == "tiny" ? 2 : 4;
    j["topk_group"] = preset == "tiny" ? 1 : 2;
    j["norm_topk_prob"] = true;
    j["routed_scaling_factor"] = 2.5;
    j["first_k_dense_replace"] = 1;
    j["partial_rotary_factor"] = 0.5;
    j["attention_bias"] = true;
    j["use_qk_norm"] = preset != "tiny";
    j["num_nextn_predict_layers"] = preset == "tiny" ? 0 : 1;
    j["rope_theta"] = 10000.0;
    j["tie_word_embeddings"] = false;
    j["hidden_act"] = "silu";
  } else if (arch == "deepseek_v3") {
    // DeepSeek-V3's layout (Moonlight, Kimi-K2): MLA (small adds the q low-rank path), the
    // sigmoid router with e_score_correction_bias and groups, shared experts, a dense first layer;
    // the bench preset has 64 routed experts and 2 shared.
    const bool tiny = preset == "tiny", bench = preset == "bench";
    j["architectures"] = {"DeepseekV3ForCausalLM"};
    j["model_type"] = "deepseek_v3";
    j["n_routed_experts"] = p.experts;
    j["n_shared_experts"] = bench ? 2 : 1;
    j["moe_intermediate_size"] = p.moe_inter;
    j["intermediate_size"] = p.dense_inter;
    j["n_group"] = tiny ? 2 : 4;
    j["topk_group"] = tiny ? 1 : 2;
    j["norm_topk_prob"] = true;
    j["routed_scaling_factor"] = 2.5;
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["first_k_dense_replace"] = 1;
    j["q_lora_rank"] = tiny ? json(nullptr) : json(bench ? 384 : 96);
    j["kv_lora_rank"] = tiny ? 32 : bench ? 256 : 64;
    j["qk_nope_head_dim"] = tiny ? 16 : bench ? 64 : 32;
    j["qk_rope_head_dim"] = tiny ? 8 : bench ? 32 : 16;
    j["v_head_dim"] = tiny ? 16 : bench ? 64 : 32;
    j["num_key_value_heads"] = p.heads;
    j["num_nextn_predict_layers"] = tiny ? 0 : 1;
    j["attention_bias"] = false;
    j["rope_interleave"] = true;
    j["rope_theta"] = 10000.0;
    if (!tiny) {
      // YaRN as DeepSeek-V3 and Kimi-K2 ship it (their factor 32-40 on a 4k pretraining
      // length); mscale != mscale_all_dim so both the cos/sin factor and the softmax scale move.
      j["max_position_embeddings"] = 4096;
      j["rope_scaling"] = {
          {"type", "yarn"},       {"factor", 4.0},  {"original_max_position_embeddings", 1024},
          {"beta_fast", 32},      {"beta_slow", 1}, {"mscale", 1.0},
          {"mscale_all_dim", 0.8}};
    }
    j["tie_word_embeddings"] = false;
    j["hidden_act"] = "silu";
  } else if (arch == "gpt_oss") {
    // GPT-OSS's layout: biased router (top-k of the logits, softmax over the k), fused experts
    // with biases and the clamped SwiGLU, q/k/v/o biases, per-head sinks, sliding and full
    // attention alternating. Windows short enough that the tests' sequences slide past them;
    // small and bench add YaRN with truncate false, as the release configures it.
    const bool tiny = preset == "tiny";
    j["architectures"] = {"GptOssForCausalLM"};
    j["model_type"] = "gpt_oss";
    j["num_local_experts"] = p.experts;
    j["intermediate_size"] = p.moe_inter;
    j["sliding_window"] = tiny ? 8 : preset == "small" ? 24 : 128;
    json types = json::array();
    for (int i = 0; i < p.layers; ++i)
      types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["attention_bias"] = true;
    j["swiglu_limit"] = 7.0;
    j["rope_theta"] = 150000.0;
    if (full) {  // gpt-oss-20b's: YaRN 32x over 4096
      j["max_position_embeddings"] = 131072;
      j["rms_norm_eps"] = 1e-5;
      j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 32.0},
                           {"beta_fast", 32.0},   {"beta_slow", 1.0},
                           {"truncate", false},   {"original_max_position_embeddings", 4096}};
    } else if (!tiny) {
      j["max_position_embeddings"] = 4096;
      j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0},
                           {"beta_fast", 32.0},   {"beta_slow", 1.0},
                           {"truncate", false},   {"original_max_position_embeddings", 1024}};
    }
    j["tie_word_embeddings"] = false;
    j["hidden_act"] = "silu";
  } else if (hybrid_arch(arch)) {
    // Qwen3-Next's and Qwen3.5-MoE's decoder: Gated DeltaNet with gated full attention on every
    // fourth layer, 1 + w norms, partial rotary 0.25, a shared expert behind a sigmoid gate.
    // qwen3_5_moe is the vision-language release (text_config, tensors under
    // model.language_model., fused experts, a vision tower and MTP weights r3 skips);
    // qwen3_5_moe_text the text-only class with per-expert tensors under model.
    const auto [nk, nv, dk, dv] = deltanet_sizes(preset);
    j["num_experts"] = p.experts;
    j["moe_intermediate_size"] = p.moe_inter;
    j["shared_expert_intermediate_size"] = p.moe_inter;
    j["head_dim"] = p.head_dim;
    j["linear_num_key_heads"] = nk;
    j["linear_num_value_heads"] = nv;
    j["linear_key_head_dim"] = dk;
    j["linear_value_head_dim"] = dv;
    j["linear_conv_kernel_dim"] = 4;
    j["full_attention_interval"] = 4;
    j["tie_word_embeddings"] = false;
    j["hidden_act"] = "silu";
    if (arch == "qwen3_next") {
      j["architectures"] = {"Qwen3NextForCausalLM"};
      j["model_type"] = "qwen3_next";
      j["norm_topk_prob"] = true;
      j["decoder_sparse_step"] = 1;
      j["mlp_only_layers"] = json::array();
      j["rope_theta"] = 1e6;
      j["partial_rotary_factor"] = 0.25;
      return j.dump(2) + "\n";
    }
    j["model_type"] = "qwen3_5_moe_text";
    json types = json::array();
    for (int i = 0; i < p.layers; ++i)
      types.push_back((i + 1) % 4 ? "linear_attention" : "full_attention");
    j["layer_types"] = types;
    j["rope_parameters"] = {{"rope_type", "default"},
                            {"rope_theta", 1e7},
                            {"partial_rotary_factor", 0.25},
                            {"mrope_section", {1, 1, 0}},
                            {"mrope_interleaved", true}};
    j["mtp_num_hidden_layers"] = 1;
    j["mtp_use_dedicated_embeddings"] = false;
    if (arch == "qwen3_5_moe_text") {
      j["architectures"] = {"Qwen3_5MoeForCausalLM"};
      return j.dump(2) + "\n";
    }
    json text = j;
    text.erase("bos_token_id");
    text.erase("eos_token_id");
    json vl = {
        {"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
        {"model_type", "qwen3_5_moe"},
        {"text_config", text},
        {"vision_config", {{"model_type", "qwen3_5_moe"}, {"hidden_size", 16}, {"depth", 1}}},
        {"image_token_id", p.vocab - 4},
        {"tie_word_embeddings", false},
        {"bos_token_id", 1},
        {"eos_token_id", 2}};
    return vl.dump(2) + "\n";
  } else {
    std::string known;
    for (const Family& f : families()) known += std::string(f.name) + ", ";
    throw Error("unknown arch \"" + arch + "\" (" + known + "qwen3_5_moe_text)");
  }
  if (arch != "qwen3_moe" && arch != "qwen2_moe" && arch != "deepseek_v3")
    j["head_dim"] = p.head_dim;
  return j.dump(2) + "\n";
}

namespace {

// The key of a tensor's random stream, hash(seed, name): a tensor does not depend on which other
// tensors exist or their order.
// A vision-language release's decoder tensors (model.language_model.*) draw the stream of their
// model.* name, and fused experts that of each expert's own tensor, so the VL and the text-only
// layouts of one seed hold the same weights.
uint64_t tensor_key(const std::string& name, uint64_t seed) {
  static const std::string vl = "model.language_model.";
  const std::string keyed = name.rfind(vl, 0) == 0 ? "model." + name.substr(vl.size()) : name;
  uint64_t key = seed;
  for (char ch : keyed) key = hash_pair(key, uint64_t(uint8_t(ch)));
  return key;
}

// One tensor's deterministic contents.
// fn(begin, end) over contiguous ranges of [0, n), on every core when the n items of
// work_per_item values each are worth the threads (ThreadPool::parallel_for splits them). Every
// value make-model writes depends on its index alone (counter-based: normal(key, i)), so the
// bytes are the same however the ranges fall.
template <typename Fn>
void on_every_core(int64_t n, int64_t work_per_item, Fn fn) {
  if (n * work_per_item < (int64_t(1) << 16)) return fn(0, n);
  ThreadPool pool(std::max(1, int(std::thread::hardware_concurrency())));
  pool.parallel_for(n, fn);
}

TensorToWrite random_tensor(const std::string& name, std::vector<int64_t> shape, DType dt,
                            uint64_t seed, float stddev, float mean = 0.f) {
  const uint64_t key = tensor_key(name, seed);
  int64_t n = 1;
  for (auto d : shape) n *= d;
  TensorToWrite t{name, dt, shape, std::vector<uint8_t>(size_t(n) * dtype_size(dt))};
  on_every_core(n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float v = mean + stddev * normal(key, uint64_t(i));
      if (dt == DType::F32) {
        std::memcpy(t.bytes.data() + 4 * i, &v, 4);
      } else {
        uint16_t h = f32_to_bf16(v);
        std::memcpy(t.bytes.data() + 2 * i, &h, 2);
      }
    }
  });
  return t;
}

// Seeded random MXFP4 experts of one fused tensor: blocks [E, rows, in/32, 16] (uniform nibbles,
// |x| ~2.4 on average before scaling) and scales [E, rows, in/32] giving values of about `stddev`,
// varied by a factor 2 either way so blocks differ. Each is made on its own, as each is a tensor.
std::vector<uint8_t> mxfp4_blocks(const std::string& name, int64_t count, uint64_t seed) {
  const uint64_t key = tensor_key(name, seed);
  std::vector<uint8_t> b(static_cast<size_t>(count / 2));
  for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(hash_pair(key, i) & 0xff);
  return b;
}
std::vector<uint8_t> mxfp4_scales(const std::string& name, int64_t count, uint64_t seed,
                                  float stddev) {
  const uint64_t key = tensor_key(name, seed) ^ 0x5ca1e;
  const int base = 127 + int(std::lround(std::log2(stddev / 2.4f)));
  std::vector<uint8_t> s(static_cast<size_t>(count / 32));
  for (size_t i = 0; i < s.size(); ++i) s[i] = uint8_t(base + int(hash_pair(key, i) % 3) - 1);
  return s;
}
struct Mxfp4Tensor {
  std::vector<uint8_t> blocks, scales;
};

// The float layout of MXFP4 experts (transformers' convert_moe_packed_tensors, then the transpose
// to [E, in, rows]): element [e, k, r] = value k of row r.
TensorToWrite dequantized(const std::string& name, const Mxfp4Tensor& m, int64_t E, int64_t rows,
                          int64_t in, DType dt) {
  TensorToWrite t{
      name, dt, {E, in, rows}, std::vector<uint8_t>(size_t(E * in * rows) * dtype_size(dt))};
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < in; ++k) {
        const size_t at = size_t((e * rows + r) * in + k);
        const uint8_t byte = m.blocks[at / 2];
        const float v = mxfp4_value(k % 2 ? byte >> 4 : byte & 15, m.scales[at / 32]);
        const size_t to = size_t((e * in + k) * rows + r);
        if (dt == DType::F32) {
          std::memcpy(t.bytes.data() + 4 * to, &v, 4);
        } else {
          const uint16_t h = f32_to_bf16(v);
          std::memcpy(t.bytes.data() + 2 * to, &h, 2);
        }
      }
  return t;
}

// Block-scaled FP8 of a seeded random matrix, as DeepSeek-V3 and transformers' Fp8Quantize make
// it: per block of br x bc, scale = max |w| / 448 (1 for an all-zero block) and each value the
// nearest e4m3 of w / scale; weight_scale_inv holds the scale.
struct Fp8Matrix {
  std::vector<uint8_t> values;   // [rows, cols] e4m3
  std::vector<float> scale_inv;  // [ceil(rows / br), ceil(cols / bc)]
};
Fp8Matrix quantize_fp8(const TensorToWrite& w, int br, int bc) {
  const int64_t rows = w.shape[0], cols = w.shape[1], rb = (rows + br - 1) / br,
                cb = (cols + bc - 1) / bc;
  const auto* f = reinterpret_cast<const float*>(w.bytes.data());
  Fp8Matrix m{std::vector<uint8_t>(size_t(rows * cols)), std::vector<float>(size_t(rb * cb), 0.f)};
  // A block row at a time (each owns its scales), on every core.
  on_every_core(rb, cols * br, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* scales = m.scale_inv.data() + b * cb;
      for (int64_t r = b * br; r < std::min(rows, (b + 1) * br); ++r)
        for (int64_t k = 0; k < cols; ++k)
          scales[k / bc] = std::max(scales[k / bc], std::fabs(f[r * cols + k]));
      for (int64_t j = 0; j < cb; ++j) scales[j] = scales[j] > 0.f ? scales[j] / 448.f : 1.f;
      for (int64_t r = b * br; r < std::min(rows, (b + 1) * br); ++r)
        for (int64_t k = 0; k < cols; ++k)
          m.values[size_t(r * cols + k)] = f32_to_e4m3(f[r * cols + k] / scales[k / bc]);
    }
  });
  return m;
}

TensorToWrite bytes_tensor(const std::string& name, std::vector<int64_t> shape,
                           std::vector<uint8_t> bytes) {
  return TensorToWrite{name, DType::U8, std::move(shape), std::move(bytes)};
}

}  // namespace

void make_model(const MakeModelOptions& opt) {
  if (opt.dtype == DType::F16) throw Error("make-model writes bf16 or f32");
  const bool mxfp4 = opt.quant == "mxfp4" || opt.quant == "mxfp4-dequantized",
             fp8 = opt.quant == "fp8" || opt.quant == "fp8-dequantized";
  if (!opt.quant.empty() && !mxfp4 && !fp8)
    throw Error("make-model: unknown quantization \"" + opt.quant +
                "\" (mxfp4, mxfp4-dequantized, fp8, fp8-dequantized)");
  if (mxfp4 && opt.arch != "gpt_oss")
    throw Error("make-model: --quant " + opt.quant +
                " is for gpt_oss (its experts are released in MXFP4)");
  if (fp8 && opt.arch == "gpt_oss")
    throw Error("make-model: --quant " + opt.quant +
                " is not for gpt_oss (released in MXFP4: --quant mxfp4)");
  const int br = opt.fp8_block[0], bc = opt.fp8_block[1];
  if (fp8 && (br < 1 || bc < 2 || bc % 2))
    throw Error("make-model: the FP8 block must be rows >= 1 x an even cols >= 2");
  std::string cfg_text = preset_config_json(opt.arch, opt.preset);
  if (!opt.config_patch.empty()) {
    json patch;
    try {
      patch = json::parse(opt.config_patch);
    } catch (const json::exception& e) {
      throw Error(std::string("make-model: --config-patch is not JSON: ") + e.what());
    }
    if (!patch.is_object()) throw Error("make-model: --config-patch must be a JSON object");
    json j = json::parse(cfg_text);
    j.merge_patch(patch);
    cfg_text = j.dump(2) + "\n";
  }
  if (opt.quant == "mxfp4") {
    json j = json::parse(cfg_text);
    j["quantization_config"] = {{"quant_method", "mxfp4"},
                                {"modules_to_not_convert",
                                 {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                  "model.embed_tokens", "lm_head"}}};
    cfg_text = j.dump(2) + "\n";
  }
  if (opt.quant == "fp8") {
    json j = json::parse(cfg_text);
    j["quantization_config"] = {{"activation_scheme", "dynamic"},
                                {"fmt", "e4m3"},
                                {"quant_method", "fp8"},
                                {"weight_block_size", {br, bc}}};
    cfg_text = j.dump(2) + "\n";
  }
  std::shared_ptr<text::Tokenizer> tok;
  if (!opt.tokenizer.empty()) {
    tok = text::Tokenizer::load(opt.tokenizer);  // refused here if r3 cannot read it
    json j = json::parse(cfg_text);
    j["vocab_size"] = (tok->vocab_size() + 63) / 64 * 64;
    if (auto id = tok->bos_id()) j["bos_token_id"] = *id;
    if (auto id = tok->eos_id()) j["eos_token_id"] = *id;
    cfg_text = j.dump(2) + "\n";
  }
  ModelConfig c = parse_config(cfg_text, "preset " + opt.arch + "/" + opt.preset);
  Preset p = get_preset(opt.arch, opt.preset);
  fs::create_directories(opt.out);
  std::ofstream(fs::path(opt.out) / "config.json") << cfg_text;
  if (tok)
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
      if (fs::exists(fs::path(opt.tokenizer) / f))
        fs::copy_file(fs::path(opt.tokenizer) / f, fs::path(opt.out) / f,
                      fs::copy_options::overwrite_existing);

  const int64_t H = c.hidden_size, hd = c.head_dim, qd = int64_t(c.num_heads) * hd,
                kvd = int64_t(c.num_kv_heads) * hd;
  const float s_in = 1.f / std::sqrt(float(H));
  const uint64_t seed = opt.seed;
  const DType dt = opt.dtype;
  // Tensors in the order HF writes them, grouped into shards by layer.
  std::vector<std::vector<std::function<TensorToWrite()>>> groups;  // per shard unit
  auto norm = [&](const std::string& n, int64_t d) {
    return [=] { return random_tensor(n, {d}, dt, seed, 0.05f, 1.f); };
  };
  auto mat = [&](const std::string& n, int64_t r, int64_t col, float sd) {
    return [=] { return random_tensor(n, {r, col}, dt, seed, sd); };
  };
  // The linear layers an FP8 release quantizes (not the embedding, lm_head, routers or the
  // shared-expert gate): its e4m3 values and weight_scale_inv, or their bf16 decoding.
  auto linear = [&](std::vector<std::function<TensorToWrite()>>& g, const std::string& n, int64_t r,
                    int64_t col, float sd) {
    if (!fp8) return g.push_back(mat(n, r, col, sd));
    auto quantized = [=] {
      return quantize_fp8(random_tensor(n, {r, col}, DType::F32, seed, sd), br, bc);
    };
    if (opt.quant == "fp8") {
      // The values' generator runs first (same shard) and leaves the scales for the next one.
      auto made = std::make_shared<Fp8Matrix>();
      g.push_back([=] {
        *made = quantized();
        return TensorToWrite{n, DType::F8_E4M3, {r, col}, made->values};
      });
      g.push_back([=] {
        const std::vector<float> s = std::move(made->scale_inv);
        *made = Fp8Matrix();
        TensorToWrite t{n + "_scale_inv",
                        DType::F32,
                        {(r + br - 1) / br, (col + bc - 1) / bc},
                        std::vector<uint8_t>(s.size() * 4)};
        std::memcpy(t.bytes.data(), s.data(), t.bytes.size());
        return t;
      });
      return;
    }
    g.push_back([=] {
      const Fp8Matrix m = quantized();
      TensorView v;
      v.dtype = DType::F8_E4M3;
      v.shape = {r, col};
      v.data = m.values.data();
      v.scale_inv = m.scale_inv.data();
      v.block_rows = br;
      v.block_cols = bc;
      TensorToWrite t{n, dt, {r, col}, std::vector<uint8_t>(size_t(r * col) * dtype_size(dt))};
      for (int64_t i = 0; i < r * col; ++i) {
        const float x = v.at(i);
        if (dt == DType::F32)
          std::memcpy(t.bytes.data() + 4 * i, &x, 4);
        else {
          const uint16_t h = f32_to_bf16(x);
          std::memcpy(t.bytes.data() + 2 * i, &h, 2);
        }
      }
      return t;
    });
  };
  auto vec = [&](const std::string& n, int64_t d, float sd, DType type, float mean = 0.f) {
    return [=] { return random_tensor(n, {d}, type, seed, sd, mean); };
  };
  auto tensor = [&](const std::string& n, std::vector<int64_t> shape, float sd) {
    return [=] { return random_tensor(n, shape, dt, seed, sd); };
  };
  // Zero-centred norms (applied as 1 + w) are drawn around 0, the others around 1.
  auto layer_norm = [&](const std::string& n, int64_t d) {
    return [=] { return random_tensor(n, {d}, dt, seed, 0.05f, c.zero_centred_norms ? 0.f : 1.f); };
  };
  std::vector<std::function<TensorToWrite()>> head = {mat(embed_name(c), c.vocab_size, H, 1.f)};
  groups.push_back(head);
  for (int i = 0; i < c.num_layers; ++i) {
    std::vector<std::function<TensorToWrite()>> g;
    const LayerTensorNames& N = layer_tensor_names(c.arch);
    auto name = [&](const std::string& relative) {
      return layer_tensor(i, relative, -1, c.tensor_prefix);
    };
    g.push_back(layer_norm(name(N.input_norm), H));
    g.push_back(layer_norm(name(N.post_norm), H));
    const AttentionSpec& attn = c.layers[size_t(i)].attention;
    if (attn.kind == AttentionKind::GatedDeltaNet) {
      const DeltaNetSpec& d = *c.deltanet;
      const int64_t kd = d.key_dim(), vd = d.value_dim(), nv = d.v_heads;
      if (d.combined_projections) {
        linear(g, name(N.dn_qkvz), 2 * kd + 2 * vd, H, s_in);
        g.push_back(mat(name(N.dn_ba), 2 * nv, H, s_in));
      } else {
        linear(g, name(N.dn_qkv), 2 * kd + vd, H, s_in);
        linear(g, name(N.dn_z), vd, H, s_in);
        g.push_back(mat(name(N.dn_b), nv, H, s_in));
        g.push_back(mat(name(N.dn_a), nv, H, s_in));
      }
      // A conv that mixes the window visibly; decays exp(-exp(A_log) softplus(a + dt_bias))
      // around 0.5 per token, so the state both remembers and forgets. Qwen3.5 releases keep
      // A_log in F32.
      g.push_back(tensor(name(N.dn_conv), {d.conv_dim(), 1, d.conv_kernel}, 0.4f));
      g.push_back(vec(name(N.dn_dt_bias), nv, 0.5f, dt));
      g.push_back(
          vec(name(N.dn_a_log), nv, 0.3f, c.arch == Arch::Qwen3_5Moe ? DType::F32 : dt, -0.8f));
      g.push_back(norm(name(N.dn_norm), d.v_head_dim));
      linear(g, name(N.dn_out), H, vd, 1.f / std::sqrt(float(vd)));
    } else if (c.mla) {
      const MlaSpec& m = *c.mla;
      const int64_t nh = c.num_heads, qk = m.qk_head_dim(), vd = nh * m.v_head_dim;
      if (m.q_lora_rank > 0) {
        linear(g, name(N.q_a), m.q_lora_rank, H, s_in);
        g.push_back(norm(name(N.q_a_norm), m.q_lora_rank));
        linear(g, name(N.q_b), nh * qk, m.q_lora_rank, 1.f / std::sqrt(float(m.q_lora_rank)));
      } else {
        linear(g, name(N.q), nh * qk, H, s_in);
      }
      linear(g, name(N.kv_a), m.latent_width(), H, s_in);
      g.push_back(norm(name(N.kv_a_norm), m.kv_lora_rank));
      linear(g, name(N.kv_b), nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank,
             1.f / std::sqrt(float(m.kv_lora_rank)));
      linear(g, name(N.o), H, vd, 1.f / std::sqrt(float(vd)));
    } else {
      linear(g, name(N.q), attn.output_gate ? 2 * qd : qd, H, s_in);
      linear(g, name(N.k), kvd, H, s_in);
      linear(g, name(N.v), kvd, H, s_in);
      linear(g, name(N.o), H, qd, 1.f / std::sqrt(float(qd)));
    }
    if (attn.qkv_bias) {
      g.push_back(vec(name(N.q_bias), qd, 0.1f, dt));
      g.push_back(vec(name(N.k_bias), kvd, 0.1f, dt));
      g.push_back(vec(name(N.v_bias), kvd, 0.1f, dt));
    }
    if (attn.o_bias) g.push_back(vec(name(N.o_bias), H, 0.1f, dt));
    // Sink logits around the scores' scale: some heads give the sink much weight, some little.
    if (attn.sinks) g.push_back(vec(name(N.sinks), c.num_heads, 1.f, dt));
    if (attn.qk_norm == QkNorm::PerHead) {
      g.push_back(layer_norm(name(N.q_norm), hd));
      g.push_back(layer_norm(name(N.k_norm), hd));
    } else if (attn.qk_norm == QkNorm::Whole) {
      g.push_back(norm(name(N.q_norm), qd));
      g.push_back(norm(name(N.k_norm), kvd));
    }
    if (c.layers[size_t(i)].moe) {
      // Router rows with std ~1.5/sqrt(H) give logits of spread ~1.5: choices vary across
      // tokens and layers, and near-ties between the K-th and (K+1)-th expert occur.
      g.push_back(mat(router_name(c, i), c.num_experts, H, 1.5f * s_in));
      // The selection bias is fp32 in released checkpoints; spread ~0.05 against sigmoid scores
      // in (0, 1) lets it change some choices.
      if (c.router.selection_bias)
        g.push_back(vec(router_bias_name(c, i), c.num_experts, 0.05f, DType::F32));
      if (c.router.logit_bias) g.push_back(vec(router_bias_name(c, i), c.num_experts, 0.3f, dt));
      const int64_t I = c.moe_intermediate_size, E = c.num_experts;
      if (N.fused_experts && opt.quant.empty()) {
        // Gate and up scaled up so that some pre-activations reach the clamp (swiglu_limit).
        g.push_back(tensor(name(N.fused_gate_up), {E, H, 2 * I}, 4.f * s_in));
        g.push_back(tensor(name(N.fused_down), {E, I, H}, 0.25f / std::sqrt(float(I))));
      } else if (N.fused_experts) {
        // MXFP4 weights of the same scales; blocks and scales, or their float decoding.
        // Per fused tensor (name, rows, inputs, value scale): its blocks and scales, or their
        // decoding.
        const std::tuple<std::string, int64_t, int64_t, float> fused[] = {
            {name(N.fused_gate_up), 2 * I, H, 4.f * s_in},
            {name(N.fused_down), H, I, 0.25f / std::sqrt(float(I))}};
        for (const auto& [n, rows, in, sd] : fused) {
          const int64_t count = E * rows * in;
          if (opt.quant == "mxfp4") {
            g.push_back([=] {
              return bytes_tensor(n + "_blocks", {E, rows, in / 32, 16},
                                  mxfp4_blocks(n, count, seed));
            });
            g.push_back([=] {
              return bytes_tensor(n + "_scales", {E, rows, in / 32},
                                  mxfp4_scales(n, count, seed, sd));
            });
          } else {
            g.push_back([=] {
              return dequantized(n,
                                 {mxfp4_blocks(n, count, seed), mxfp4_scales(n, count, seed, sd)},
                                 E, rows, in, dt);
            });
          }
        }
      }
      if (N.fused_experts) {
        g.push_back(tensor(name(N.fused_gate_up_bias), {E, 2 * I}, 0.5f));
        g.push_back(tensor(name(N.fused_down_bias), {E, H}, 0.1f));
      }
      // Qwen3.5's release stores its experts fused in nn.Linear's layout ([E, 2I, H]: gate rows,
      // then up rows; [E, H, I]); the text-only class (qwen3_5_moe_text) one tensor per expert.
      const bool fused_linear = N.fused_experts_linear && c.vision_tower;
      if (fused_linear) {
        // Names made now: the loop's `name` reads the layer index by reference.
        const std::string gate_up_name = name(N.fused_gate_up), down_name = name(N.fused_down);
        g.push_back([=] {
          TensorToWrite t{gate_up_name, dt, {E, 2 * I, H}, {}};
          for (int64_t e = 0; e < E; ++e)
            for (const char* which : {"gate", "up"}) {
              const TensorToWrite one =
                  random_tensor(expert_name(c, i, int(e), which), {I, H}, dt, seed, s_in);
              t.bytes.insert(t.bytes.end(), one.bytes.begin(), one.bytes.end());
            }
          return t;
        });
        g.push_back([=] {
          TensorToWrite t{down_name, dt, {E, H, I}, {}};
          for (int64_t e = 0; e < E; ++e) {
            const TensorToWrite one = random_tensor(expert_name(c, i, int(e), "down"), {H, I}, dt,
                                                    seed, 1.f / std::sqrt(float(I)));
            t.bytes.insert(t.bytes.end(), one.bytes.begin(), one.bytes.end());
          }
          return t;
        });
      }
      for (int e = 0; e < c.num_experts && !N.fused_experts && !fused_linear; ++e) {
        linear(g, expert_name(c, i, e, "gate"), I, H, s_in);
        linear(g, expert_name(c, i, e, "up"), I, H, s_in);
        linear(g, expert_name(c, i, e, "down"), H, I, 1.f / std::sqrt(float(I)));
      }
      const LayerConfig& lc = c.layers[size_t(i)];
      if (lc.shared_intermediate > 0) {
        const int64_t S = lc.shared_intermediate;
        linear(g, shared_expert_name(c, i, "gate"), S, H, s_in);
        linear(g, shared_expert_name(c, i, "up"), S, H, s_in);
        linear(g, shared_expert_name(c, i, "down"), H, S, 1.f / std::sqrt(float(S)));
        if (lc.shared_gate) g.push_back(mat(shared_gate_name(c, i), 1, H, s_in));
      }
    } else {
      const int64_t I = c.intermediate_size;
      linear(g, dense_name(c, i, "gate"), I, H, s_in);
      linear(g, dense_name(c, i, "up"), I, H, s_in);
      linear(g, dense_name(c, i, "down"), H, I, 1.f / std::sqrt(float(I)));
    }
    groups.push_back(g);
  }
  // MTP layers as released checkpoints store them after the decoder layers (a few of their
  // tensors: r3 must recognise and skip them, never run them).
  for (int m = 0; m < c.num_nextn_predict_layers; ++m) {
    const std::string pf = layer_prefix(c.num_layers + m);
    groups.push_back({norm(pf + "enorm.weight", H), norm(pf + "hnorm.weight", H),
                      mat(pf + "eh_proj.weight", H, 2 * H, s_in),
                      norm(pf + "input_layernorm.weight", H)});
  }
  // Qwen3-Next / Qwen3.5 MTP weights (mtp.*) and a vision-language release's vision tower: a few
  // of their tensors, which r3 must recognise and skip.
  if (c.num_mtp_layers > 0)
    groups.push_back(
        {mat("mtp.fc.weight", H, 2 * H, s_in), layer_norm("mtp.pre_fc_norm_embedding.weight", H),
         layer_norm("mtp.layers.0.input_layernorm.weight", H), layer_norm("mtp.norm.weight", H)});
  if (c.vision_tower)
    groups.push_back({mat("model.visual.patch_embed.proj.weight", 16, 48, 0.1f),
                      norm("model.visual.blocks.0.norm1.weight", 16)});
  std::vector<std::function<TensorToWrite()>> tail = {
      layer_norm(c.tensor_prefix + "norm.weight", H)};
  if (!c.tie_word_embeddings) tail.push_back(mat("lm_head.weight", c.vocab_size, H, s_in));
  groups.push_back(tail);

  const int shards = p.shards;
  json weight_map = json::object();
  uint64_t total = 0;
  for (int s = 0; s < shards; ++s) {
    size_t g0 = groups.size() * size_t(s) / size_t(shards),
           g1 = groups.size() * size_t(s + 1) / size_t(shards);
    std::vector<TensorToWrite> tensors;
    for (size_t g = g0; g < g1; ++g)
      for (auto& make : groups[g]) tensors.push_back(make());
    std::string file = shards == 1 ? "model.safetensors"
                                   : "model-" + std::string(5 - std::to_string(s + 1).size(), '0') +
                                         std::to_string(s + 1) + "-of-" +
                                         std::string(5 - std::to_string(shards).size(), '0') +
                                         std::to_string(shards) + ".safetensors";
    for (auto& t : tensors) {
      weight_map[t.name] = file;
      total += t.bytes.size();
    }
    write_safetensors((fs::path(opt.out) / file).string(), tensors);
  }
  if (shards > 1) {
    json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream(fs::path(opt.out) / "model.safetensors.index.json") << idx.dump(2) << "\n";
  }
}

}  // namespace r3
