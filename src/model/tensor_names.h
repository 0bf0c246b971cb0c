// The Hugging Face tensor names of each architecture, as data: one table per family, names
// relative to "model.layers.{i}." with "{e}" for the expert index. The loader and make-model
// both read them; adding a family with another naming is one more table.
#pragma once
#include <array>
#include <string>

#include "model/config.h"

namespace r3 {

struct LayerTensorNames {
  std::string input_norm = "input_layernorm.weight", post_norm = "post_attention_layernorm.weight";
  // GQA
  std::string q = "self_attn.q_proj.weight", k = "self_attn.k_proj.weight",
              v = "self_attn.v_proj.weight", o = "self_attn.o_proj.weight";
  std::string q_bias = "self_attn.q_proj.bias", k_bias = "self_attn.k_proj.bias",
              v_bias = "self_attn.v_proj.bias";
  std::string q_norm = "self_attn.q_norm.weight", k_norm = "self_attn.k_norm.weight";
  std::string o_bias = "self_attn.o_proj.bias", sinks = "self_attn.sinks";
  // MLA (q is q_proj without q_lora_rank)
  std::string q_a = "self_attn.q_a_proj.weight", q_a_norm = "self_attn.q_a_layernorm.weight",
              q_b = "self_attn.q_b_proj.weight", kv_a = "self_attn.kv_a_proj_with_mqa.weight",
              kv_a_norm = "self_attn.kv_a_layernorm.weight", kv_b = "self_attn.kv_b_proj.weight";
  // MoE
  std::string router = "mlp.gate.weight", router_bias = "mlp.gate.e_score_correction_bias";
  std::array<std::string, 3> expert = {"mlp.experts.{e}.gate_proj.weight",
                                       "mlp.experts.{e}.up_proj.weight",
                                       "mlp.experts.{e}.down_proj.weight"};  // gate, up, down
  std::array<std::string, 3> shared = {"mlp.shared_experts.gate_proj.weight",
                                       "mlp.shared_experts.up_proj.weight",
                                       "mlp.shared_experts.down_proj.weight"};
  std::string shared_gate = "mlp.shared_expert_gate.weight";
  // Experts stored fused, one tensor for all of them (GPT-OSS): gate_up [E, H, 2I] with gate and
  // up interleaved along the last axis, its bias [E, 2I]; down [E, I, H], its bias [E, H]. The
  // inputs come first (x @ W), unlike nn.Linear.
  bool fused_experts = false;
  std::string fused_gate_up = "mlp.experts.gate_up_proj",
              fused_gate_up_bias = "mlp.experts.gate_up_proj_bias",
              fused_down = "mlp.experts.down_proj", fused_down_bias = "mlp.experts.down_proj_bias";
  // Experts stored fused in nn.Linear's layout (Qwen3.5-MoE as released): gate_up [E, 2I, H], each
  // expert's I gate rows then its I up rows, and down [E, H, I], under the fused names above. A
  // checkpoint may store them per expert instead (the `expert` names): the loader takes what the
  // files hold.
  bool fused_experts_linear = false;
  // Gated DeltaNet (linear_attn): Qwen3-Next's combined projections, or Qwen3.5's separate ones
  // (DeltaNetSpec::combined_projections); the conv, decay and gated-norm tensors; out_proj.
  std::string dn_qkvz = "linear_attn.in_proj_qkvz.weight", dn_ba = "linear_attn.in_proj_ba.weight";
  std::string dn_qkv = "linear_attn.in_proj_qkv.weight", dn_z = "linear_attn.in_proj_z.weight",
              dn_b = "linear_attn.in_proj_b.weight", dn_a = "linear_attn.in_proj_a.weight";
  std::string dn_conv = "linear_attn.conv1d.weight", dn_dt_bias = "linear_attn.dt_bias",
              dn_a_log = "linear_attn.A_log", dn_norm = "linear_attn.norm.weight",
              dn_out = "linear_attn.out_proj.weight";
  // Dense MLP
  std::array<std::string, 3> dense = {"mlp.gate_proj.weight", "mlp.up_proj.weight",
                                      "mlp.down_proj.weight"};
};

const LayerTensorNames& layer_tensor_names(Arch a);
// The full name of a layer's tensor: prefix + "layers.{layer}." + relative, with {e} = expert;
// prefix is ModelConfig::tensor_prefix ("model.", or "model.language_model." in a
// vision-language release).
std::string layer_tensor(int layer, const std::string& relative, int expert = -1,
                         const std::string& prefix = "model.");

}  // namespace r3
