// Writes seeded random MoE checkpoints in exactly the Hugging Face layout, so tests and benches
// exercise the same loader as real checkpoints do. Byte-identical for the same arguments.
#pragma once
#include <string>

#include "core/dtype.h"
#include "model/config.h"

namespace r3 {

struct MakeModelOptions {
  std::string arch =
      "olmoe";  // mixtral | qwen3_moe | olmoe | qwen2_moe | glm4_moe | deepseek_v3 | gpt_oss |
                // qwen3_next | qwen3_5_moe (the VL release) | qwen3_5_moe_text
  std::string preset = "tiny";  // tiny | small | bench
  uint64_t seed = 0;
  DType dtype = DType::BF16;  // BF16 or F32
  std::string out;
  // A directory with tokenizer.json (+ tokenizer_config.json): copied into the checkpoint, the
  // vocabulary sized to it (rounded up to a multiple of 64) and bos/eos ids taken from it.
  std::string tokenizer;
  // gpt_oss experts: "" (float, `dtype`), "mxfp4" (blocks and scales with quantization_config, as
  // released), or "mxfp4-dequantized" (the same MXFP4 weights decoded into the float layout, as
  // transformers' dequantize writes them): the last two hold identical values.
  // Other architectures: "fp8" (the linear layers as F8_E4M3 with weight_scale_inv per block of
  // fp8_block, quantization_config fp8, as DeepSeek-V3 is released) or "fp8-dequantized" (the
  // same values decoded, each rounded once to `dtype`, as the engine decodes them).
  std::string quant;
  int fp8_block[2] = {128, 128};  // weight_block_size: rows, cols (cols even)
  // A JSON object merged into the preset's config.json (RFC 7386) before the weights are drawn,
  // so the tensors follow it: e.g. {"num_experts": 512, "num_experts_per_tok": 22}.
  std::string config_patch;
};

// The config.json text of a preset (throws r3::Error for unknown arch or preset).
std::string preset_config_json(const std::string& arch, const std::string& preset);
void make_model(const MakeModelOptions& opt);

}  // namespace r3
