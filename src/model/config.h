// The model description r3 needs, parsed once from a Hugging Face config.json: the model-wide
// sizes, the router, and per decoder layer what its attention and FFN are (LayerConfig). The
// checkpoint loader, make-model, the reference forward and the engine all read it; an
// architecture is a way of filling it (docs/ARCHITECTURE.md lists the facts per family).
#pragma once
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace r3 {

enum class Arch {
  Mixtral,
  Qwen3Moe,
  Olmoe,
  Qwen2Moe,
  Glm4Moe,
  DeepseekV3,
  GptOss,
  Qwen3Next,
  Qwen3_5Moe
};

// Where q/k RMSNorm sits: none (Mixtral), per head before RoPE (Qwen3-MoE), or over the whole
// projection before the heads are split (OLMoE).
enum class QkNorm { None, PerHead, Whole };

// How a MoE layer picks its experts and weighs them (engine/router.h implements it).
// TopkSoftmax (GPT-OSS): the k largest logits, weighted by a softmax over those k only.
enum class RouterScoring { Softmax, Sigmoid, TopkSoftmax };
struct RouterSpec {
  RouterScoring scoring =
      RouterScoring::Softmax;  // softmax over all experts, or per-expert sigmoid
  bool logit_bias = false;  // the router has a bias added to its logits (GPT-OSS mlp.router.bias)
  bool selection_bias = false;  // e_score_correction_bias: added to the scores for choosing only
  int n_group = 1,
      topk_group = 1;        // group-limited choice: the experts of the topk_group best groups
  bool renormalize = false;  // gate weights divided by their sum over the k chosen
  float routed_scaling_factor = 1.f;  // gate weights multiplied by this after renormalisation
};

// RoPE's frequencies: theta^(-2i/dim) for the rotary dims, or YaRN's blend of interpolated and
// extrapolated frequencies (rope_scaling.rope_type "yarn", transformers' _compute_yarn_parameters)
// with cos and sin scaled by attention_factor.
struct RopeScaling {
  bool yarn = false;
  double factor = 1.0;
  int original_max_position_embeddings = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 1.0;  // cos and sin are multiplied by it
  double softmax_mscale = 1.0;    // MLA: the softmax scale is multiplied by it (mscale_all_dim)
};

// Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank bottleneck,
// keys and values from one compressed latent per token (kv_lora_rank) plus a shared rotary key
// part (qk_rope_head_dim). The KV cache holds only the latent and the rotary part.
// transformers builds MLA's q_a_layernorm and kv_a_layernorm without passing rms_norm_eps, so
// they keep DeepseekV3RMSNorm's default.
inline constexpr float kMlaNormEps = 1e-6f;

struct MlaSpec {
  int q_lora_rank = 0;  // 0: q_proj straight from the hidden state
  int kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int latent_width() const {
    return kv_lora_rank + qk_rope_head_dim;
  }  // cached per token and layer
};

// Gated DeltaNet (Qwen3-Next, Qwen3.5): linear attention whose memory is a recurrent state per
// request and layer, [v_heads][k_head_dim][v_head_dim] fp32, plus the last conv_kernel - 1 inputs
// of its causal depthwise convolution over the q, k, v channels. Value heads share key heads in
// groups of v_heads / k_heads. Sizes are model-wide; which layers are DeltaNet is per layer.
struct DeltaNetSpec {
  int k_heads = 0, v_heads = 0, k_head_dim = 0, v_head_dim = 0, conv_kernel = 0;
  // Qwen3-Next stores in_proj_qkvz and in_proj_ba with their outputs ordered per key-head group
  // ([q, k, v of the group's value heads, z of them] per group; [b, a] likewise); Qwen3.5 stores
  // in_proj_qkv (q, k, v in order), in_proj_z, in_proj_b and in_proj_a.
  bool combined_projections = false;
  int key_dim() const { return k_heads * k_head_dim; }
  int value_dim() const { return v_heads * v_head_dim; }
  int conv_dim() const { return 2 * key_dim() + value_dim(); }  // channels: q, k, v
  // fp32 values of one request's state in one DeltaNet layer: the recurrent state and the conv's
  // window of earlier inputs.
  int64_t state_floats() const {
    return int64_t(v_heads) * k_head_dim * v_head_dim + int64_t(conv_dim()) * (conv_kernel - 1);
  }
  bool operator==(const DeltaNetSpec&) const = default;
};

// One decoder layer's attention. MLA's sizes are model-wide (ModelConfig::mla), as are the
// DeltaNet's (ModelConfig::deltanet).
enum class AttentionKind { Gqa, Mla, GatedDeltaNet };
struct AttentionSpec {
  AttentionKind kind = AttentionKind::Gqa;
  QkNorm qk_norm = QkNorm::None;  // GQA
  bool qkv_bias = false;          // GQA: q/k/v projections carry a bias (o never does)
  std::optional<float> clip_qkv;  // GQA: q, k, v clamped after the norms (OLMoE)
  int rotary_dim = 0;             // leading dims of each head that RoPE rotates
  bool rope_interleaved = false;  // RoPE rotates pairs (2i, 2i+1) instead of (i, i + dim/2)
  bool o_bias = false;            // GQA: o_proj carries a bias (GPT-OSS)
  bool sinks = false;             // GQA: a learned logit per head joins each softmax's denominator
  int sliding_window = 0;         // > 0: a query at p attends keys p - sliding_window + 1 .. p only
  // GQA: q_proj gives each head [query, gate] (2 x head_dim rows) and the attention output is
  // multiplied by sigmoid(gate) before o_proj (Qwen3-Next, Qwen3.5).
  bool output_gate = false;
  bool operator==(const AttentionSpec&) const = default;
};

// The experts' gated activation: SwiGLU, silu(gate) * up, or GPT-OSS's clamped form
// (gate clamped above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha
// gate)).
struct ExpertActivation {
  bool clamped = false;
  float alpha = 1.702f, limit = 7.f;
  bool operator==(const ExpertActivation&) const = default;
};

// One decoder layer: its attention, and its FFN kind and sizes.
struct LayerConfig {
  AttentionSpec attention;
  bool moe = true;              // routed experts, or a dense SwiGLU MLP
  int intermediate = 0;         // per expert (MoE) or of the dense MLP
  int shared_intermediate = 0;  // shared experts fused as one MLP of this size (0: none)
  bool shared_gate = false;     // the shared MLP's output scaled by sigmoid(gate . h)
  bool expert_bias = false;     // each expert's gate, up and down carry biases (GPT-OSS)
  ExpertActivation activation;  // of the routed experts
};

struct ModelConfig {
  Arch arch = Arch::Mixtral;
  std::string architecture;  // the HF name, e.g. "MixtralForCausalLM"
  int vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0,
      head_dim = 0;
  int num_experts = 0, top_k = 0;
  int moe_intermediate_size = 0;  // per expert
  int intermediate_size = 0;      // dense layers (Qwen3-MoE mlp_only_layers)
  bool norm_topk_prob = true;
  RopeScaling rope_scaling;
  std::optional<MlaSpec> mla;            // multi-head latent attention instead of GQA
  std::optional<DeltaNetSpec> deltanet;  // the sizes of the Gated DeltaNet layers (hybrids)
  // Every RMSNorm weight is applied as (1 + w) (Qwen3-Next, Qwen3.5: zero-centred norms), except
  // the DeltaNet's gated norm.
  bool zero_centred_norms = false;
  // Where the decoder's tensors live: "model." (model.layers.N..., model.embed_tokens, model.norm),
  // or "model.language_model." in a vision-language release (Qwen3.5-MoE), whose vision tower
  // (model.visual.*) r3 does not read.
  std::string tensor_prefix = "model.";
  bool vision_tower = false;         // the checkpoint has one (image inputs are refused)
  int num_mtp_layers = 0;            // Qwen3-Next / Qwen3.5 mtp.* weights: not run
  int num_nextn_predict_layers = 0;  // MTP layers stored after the decoder layers: not run
  RouterSpec router;
  // quantization_config {"quant_method": "mxfp4"} (GPT-OSS as released): the routed experts are
  // stored as MXFP4 blocks and scales, everything else in the checkpoint's float dtype.
  bool experts_mxfp4 = false;
  // quantization_config {"quant_method": "fp8", "weight_block_size": [rows, cols]} (DeepSeek-V3,
  // Kimi-K2, Qwen3 FP8 as released): weights stored as F8_E4M3 come with a fp32 weight_scale_inv
  // per block of rows x cols. 0 when the checkpoint has none.
  int fp8_block_rows = 0, fp8_block_cols = 0;
  std::vector<LayerConfig> layers;  // per decoder layer
  float rope_theta = 10000.f, rms_norm_eps = 1e-5f;
  bool tie_word_embeddings = false;
  int max_position_embeddings = 4096;
  int eos_token_id = -1, bos_token_id = -1;

  std::vector<int> moe_layers() const;  // decoder-layer index of each MoE column
  // KV-cache elements per token and layer, K and V together (GQA: 2 x kv heads x head_dim; MLA:
  // the latent and the rotary key part).
  int64_t kv_cache_width() const;
  int num_moe_layers() const;
  int num_deltanet_layers() const;
  bool hybrid() const { return deltanet.has_value(); }  // has DeltaNet layers with recurrent state
};

// The one walk over the description (as gemma.cpp's configs visit theirs): v(name, value) for
// every field, in a fixed order, nested parts named with dots ("router.n_group",
// "layers.3.attention.sliding_window"): v gets a reference to the field (int, bool, float,
// double, std::string or an enum; mutable when c is), or std::nullopt for an absent optional
// part. config_differences and the Python model_config read the description through it, so a
// new field is one line here.
template <class Config, class V>
void visit_fields(Config& c, V&& v) {
  static_assert(std::is_same_v<std::remove_const_t<Config>, ModelConfig>);
  v("arch", c.arch);
  v("architecture", c.architecture);
  v("vocab_size", c.vocab_size);
  v("hidden_size", c.hidden_size);
  v("num_layers", c.num_layers);
  v("num_heads", c.num_heads);
  v("num_kv_heads", c.num_kv_heads);
  v("head_dim", c.head_dim);
  v("num_experts", c.num_experts);
  v("top_k", c.top_k);
  v("moe_intermediate_size", c.moe_intermediate_size);
  v("intermediate_size", c.intermediate_size);
  v("norm_topk_prob", c.norm_topk_prob);
  auto& y = c.rope_scaling;
  v("rope_scaling.yarn", y.yarn);
  v("rope_scaling.factor", y.factor);
  v("rope_scaling.original_max_position_embeddings", y.original_max_position_embeddings);
  v("rope_scaling.beta_fast", y.beta_fast);
  v("rope_scaling.beta_slow", y.beta_slow);
  v("rope_scaling.truncate", y.truncate);
  v("rope_scaling.attention_factor", y.attention_factor);
  v("rope_scaling.softmax_mscale", y.softmax_mscale);
  if (!c.mla) {
    v("mla", std::nullopt);
  } else {
    v("mla.q_lora_rank", c.mla->q_lora_rank);
    v("mla.kv_lora_rank", c.mla->kv_lora_rank);
    v("mla.qk_nope_head_dim", c.mla->qk_nope_head_dim);
    v("mla.qk_rope_head_dim", c.mla->qk_rope_head_dim);
    v("mla.v_head_dim", c.mla->v_head_dim);
  }
  if (!c.deltanet) {
    v("deltanet", std::nullopt);
  } else {
    v("deltanet.k_heads", c.deltanet->k_heads);
    v("deltanet.v_heads", c.deltanet->v_heads);
    v("deltanet.k_head_dim", c.deltanet->k_head_dim);
    v("deltanet.v_head_dim", c.deltanet->v_head_dim);
    v("deltanet.conv_kernel", c.deltanet->conv_kernel);
    v("deltanet.combined_projections", c.deltanet->combined_projections);
  }
  v("zero_centred_norms", c.zero_centred_norms);
  v("tensor_prefix", c.tensor_prefix);
  v("vision_tower", c.vision_tower);
  v("num_mtp_layers", c.num_mtp_layers);
  v("num_nextn_predict_layers", c.num_nextn_predict_layers);
  v("router.scoring", c.router.scoring);
  v("router.logit_bias", c.router.logit_bias);
  v("router.selection_bias", c.router.selection_bias);
  v("router.n_group", c.router.n_group);
  v("router.topk_group", c.router.topk_group);
  v("router.renormalize", c.router.renormalize);
  v("router.routed_scaling_factor", c.router.routed_scaling_factor);
  v("experts_mxfp4", c.experts_mxfp4);
  v("fp8_block_rows", c.fp8_block_rows);
  v("fp8_block_cols", c.fp8_block_cols);
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    auto& L = c.layers[i];
    auto& a = L.attention;
    v(l + "attention.kind", a.kind);
    v(l + "attention.qk_norm", a.qk_norm);
    v(l + "attention.qkv_bias", a.qkv_bias);
    if (a.clip_qkv)
      v(l + "attention.clip_qkv", *a.clip_qkv);
    else
      v(l + "attention.clip_qkv", std::nullopt);
    v(l + "attention.rotary_dim", a.rotary_dim);
    v(l + "attention.rope_interleaved", a.rope_interleaved);
    v(l + "attention.o_bias", a.o_bias);
    v(l + "attention.sinks", a.sinks);
    v(l + "attention.sliding_window", a.sliding_window);
    v(l + "attention.output_gate", a.output_gate);
    v(l + "moe", L.moe);
    v(l + "intermediate", L.intermediate);
    v(l + "shared_intermediate", L.shared_intermediate);
    v(l + "shared_gate", L.shared_gate);
    v(l + "expert_bias", L.expert_bias);
    v(l + "activation.clamped", L.activation.clamped);
    v(l + "activation.alpha", L.activation.alpha);
    v(l + "activation.limit", L.activation.limit);
  }
  v("rope_theta", c.rope_theta);
  v("rms_norm_eps", c.rms_norm_eps);
  v("tie_word_embeddings", c.tie_word_embeddings);
  v("max_position_embeddings", c.max_position_embeddings);
  v("eos_token_id", c.eos_token_id);
  v("bos_token_id", c.bos_token_id);
}

// Throws r3::Error naming `path` and the key for malformed JSON, unknown architectures, missing
// or out-of-range keys, and keys whose feature r3 does not implement (biases, sliding windows,
// rope scaling types, quantization, other activations).
ModelConfig parse_config(const std::string& json_text, const std::string& path);
ModelConfig load_config(const std::string& path);
// The rotary_dim / 2 inverse frequencies of RoPE under c.rope_scaling (in double; callers round
// as they compute).
std::vector<double> rope_inv_freq(const ModelConfig& c, int rotary_dim);
std::string arch_short_name(Arch a);  // "mixtral", "qwen3_moe", ..., "qwen3_next", "qwen3_5_moe"
// The fields (visit_fields) whose values differ between a and b ("rope_theta: 10000 -> 20000",
// every digit), empty when the two describe the same model; past 16 lines, one more says how
// many were left out. A refit is refused unless this is empty.
std::vector<std::string> config_differences(const ModelConfig& a, const ModelConfig& b);

}  // namespace r3
