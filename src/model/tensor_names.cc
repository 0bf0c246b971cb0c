#include "model/tensor_names.h"

namespace r3 {

namespace {

LayerTensorNames mixtral() {
  LayerTensorNames n;
  n.router = "block_sparse_moe.gate.weight";
  n.expert = {"block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
              "block_sparse_moe.experts.{e}.w2.weight"};
  return n;
}

LayerTensorNames qwen2_moe() {
  LayerTensorNames n;
  n.shared = {"mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
              "mlp.shared_expert.down_proj.weight"};
  return n;
}

LayerTensorNames gpt_oss() {
  LayerTensorNames n;
  n.router = "mlp.router.weight";
  n.router_bias = "mlp.router.bias";
  n.fused_experts = true;
  return n;
}

// Qwen3-Next and Qwen3.5: Qwen2-MoE's shared expert; Qwen3.5 may store its experts fused.
LayerTensorNames qwen3_5_moe() {
  LayerTensorNames n = qwen2_moe();
  n.fused_experts_linear = true;
  return n;
}

}  // namespace

const LayerTensorNames& layer_tensor_names(Arch a) {
  static const LayerTensorNames standard, mixtral_names = mixtral(), qwen2_names = qwen2_moe(),
                                          gpt_oss_names = gpt_oss(), qwen3_5_names = qwen3_5_moe();
  switch (a) {
    case Arch::Mixtral:
      return mixtral_names;
    case Arch::Qwen2Moe:
    case Arch::Qwen3Next:
      return qwen2_names;
    case Arch::Qwen3_5Moe:
      return qwen3_5_names;
    case Arch::GptOss:
      return gpt_oss_names;
    default:
      return standard;  // Qwen3-MoE, OLMoE, GLM-4.5, DeepSeek-V3
  }
}

std::string layer_tensor(int layer, const std::string& relative, int expert,
                         const std::string& prefix) {
  std::string name = prefix + "layers." + std::to_string(layer) + "." + relative;
  const size_t at = name.find("{e}");
  if (at != std::string::npos) name.replace(at, 3, std::to_string(expert));
  return name;
}

}  // namespace r3
