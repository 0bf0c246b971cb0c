// The model configuration r3 needs, parsed from a Hugging Face config.json for the three
// supported MoE architectures (FACTS.md lists their keys).
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace r3 {

enum class Arch { Mixtral, Qwen3Moe, Olmoe };

// Where q/k RMSNorm sits: none (Mixtral), per head before RoPE (Qwen3-MoE), or over the whole
// projection before the heads are split (OLMoE).
enum class QkNorm { None, PerHead, Whole };

struct ModelConfig {
  Arch arch = Arch::Mixtral;
  std::string architecture;  // the HF name, e.g. "MixtralForCausalLM"
  int vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0,
      head_dim = 0;
  int num_experts = 0, top_k = 0;
  int moe_intermediate_size = 0;  // per expert
  int intermediate_size = 0;      // dense layers (Qwen3-MoE mlp_only_layers)
  bool norm_topk_prob = true;
  QkNorm qk_norm = QkNorm::None;
  std::optional<float> clip_qkv;
  float rope_theta = 10000.f, rms_norm_eps = 1e-5f;
  bool tie_word_embeddings = false;
  int max_position_embeddings = 4096;
  int eos_token_id = -1, bos_token_id = -1;
  std::vector<bool> layer_is_moe;  // per decoder layer

  std::vector<int> moe_layers() const;  // decoder-layer index of each MoE column
  int num_moe_layers() const;
};

// Throws r3::Error naming `path` and the key for malformed JSON, unknown architectures, missing
// or out-of-range keys, and keys whose feature r3 does not implement (biases, sliding windows,
// rope scaling types, quantization, other activations).
ModelConfig parse_config(const std::string& json_text, const std::string& path);
ModelConfig load_config(const std::string& path);
std::string arch_short_name(Arch a);  // "mixtral", "qwen3_moe", "olmoe"
// The config keys whose values differ between a and b ("rope_theta: 10000 -> 20000"), empty when
// the two describe the same model. A refit is refused unless this is empty.
std::vector<std::string> config_differences(const ModelConfig& a, const ModelConfig& b);

}  // namespace r3
