#include "model/families.h"

namespace r3 {

const std::vector<Family>& families() {
  static const std::vector<Family> table = {
      {Arch::Mixtral, "mixtral", {"MixtralForCausalLM"}},
      {Arch::Qwen3Moe, "qwen3_moe", {"Qwen3MoeForCausalLM"}},
      {Arch::Olmoe, "olmoe", {"OlmoeForCausalLM"}},
      {Arch::Qwen2Moe, "qwen2_moe", {"Qwen2MoeForCausalLM"}},
      {Arch::Glm4Moe, "glm4_moe", {"Glm4MoeForCausalLM"}},
      {Arch::DeepseekV3, "deepseek_v3", {"DeepseekV3ForCausalLM"}},
      {Arch::GptOss, "gpt_oss", {"GptOssForCausalLM"}},
      {Arch::Qwen3Next, "qwen3_next", {"Qwen3NextForCausalLM"}},
      // The text-only class and the vision-language release (its decoder under text_config).
      {Arch::Qwen3_5Moe,
       "qwen3_5_moe",
       {"Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"}},
  };
  return table;
}

const Family* family_of_hf_class(const std::string& hf_class) {
  for (const Family& f : families())
    for (const char* c : f.hf_classes)
      if (hf_class == c) return &f;
  return nullptr;
}

std::string supported_hf_classes() {
  std::string out;
  for (const Family& f : families())
    for (const char* c : f.hf_classes) out += (out.empty() ? "" : ", ") + std::string(c);
  return out;
}

}  // namespace r3
