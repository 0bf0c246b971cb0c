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
  std::string q = "self_attn.q_proj.weight", k = "self_attn.k_proj.weight", v = "self_attn.v_proj.weight",
              o = "self_attn.o_proj.weight";
  std::string q_bias = "self_attn.q_proj.bias", k_bias = "self_attn.k_proj.bias", v_bias = "self_attn.v_proj.bias";
  std::string q_norm = "self_attn.q_norm.weight", k_norm = "self_attn.k_norm.weight";
  std::string o_bias = "self_attn.o_proj.bias", sinks = "self_attn.sinks";
  // MLA (q is q_proj without q_lora_rank)
  std::string q_a = "self_attn.q_a_proj.weight", q_a_norm = "self_attn.q_a_layernorm.weight",
              q_b = "self_attn.q_b_proj.weight", kv_a = "self_attn.kv_a_proj_with_mqa.weight",
              kv_a_norm = "self_attn.kv_a_layernorm.weight", kv_b = "self_attn.kv_b_proj.weight";
  // MoE
  std::string router = "mlp.gate.weight", router_bias = "mlp.gate.e_score_correction_bias";
  std::array<std::string, 3> expert = {"mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                                       "mlp.experts.{e}.down_proj.weight"};  // gate, up, down
  std::array<std::string, 3> shared = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                                       "mlp.shared_experts.down_proj.weight"};
  std::string shared_gate = "mlp.shared_expert_gate.weight";
  // Experts stored fused, one tensor for all of them (GPT-OSS): gate_up [E, H, 2I] with gate and
  // up interleaved along the last axis, its bias [E, 2I]; down [E, I, H], its bias [E, H]. The
  // inputs come first (x @ W), unlike nn.Linear.
  bool fused_experts = false;
  std::string fused_gate_up = "mlp.experts.gate_up_proj", fused_gate_up_bias = "mlp.experts.gate_up_proj_bias",
              fused_down = "mlp.experts.down_proj", fused_down_bias = "mlp.experts.down_proj_bias";
  // Dense MLP
  std::array<std::string, 3> dense = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"};
};

const LayerTensorNames& layer_tensor_names(Arch a);
// The full name of a layer's tensor: "model.layers.{layer}." + relative, with {e} = expert.
std::string layer_tensor(int layer, const std::string& relative, int expert = -1);

}  // namespace r3
