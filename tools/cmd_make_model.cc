#include <cstdio>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "model/make_model.h"

namespace r3::cli {

int cmd_make_model(int argc, char** argv) {
  Args a("make-model",
         "Writes a checkpoint with seeded random weights in the Hugging Face layout\n"
         "(config.json + safetensors, sharded for small and bench, one shard per layer for full,\n"
         "written a shard at a time so make-model holds one layer's tensors at most).");
  a.opt("arch", "olmoe",
        "mixtral | qwen3_moe | olmoe | qwen2_moe | glm4_moe | deepseek_v3 | gpt_oss | qwen3_next | "
        "qwen3_5_moe "
        "(the vision-language release layout) | qwen3_5_moe_text")
      .opt("preset", "tiny",
           "tiny | small | bench | full. full: the released shapes of OLMoE-1B-7B-0924 (--arch\n"
           "olmoe, 6.9B parameters, 13.8 GB in bf16), gpt-oss-20b (--arch gpt_oss --quant mxfp4,\n"
           "12.8 GB) and Qwen3-30B-A3B (--arch qwen3_moe, 61 GB in bf16, 31 GB with --quant fp8).\n"
           "On a 24 GiB machine r3 serves the first two (every weight is held once: about the\n"
           "checkpoint's bytes + the KV pool); Qwen3-30B-A3B needs a bigger one")
      .opt("seed", "0", "weight seed")
      .opt("dtype", "bf16", "bf16 | f32")
      .opt("out", "", "output directory (required)")
      .opt("tokenizer", "",
           "directory with a tokenizer.json to copy in (the vocabulary is sized to it)")
      .opt(
          "quant", "",
          "gpt_oss experts: mxfp4 (blocks and scales, as released) or mxfp4-dequantized (the same\n"
          "weights decoded into the --dtype layout); other architectures: fp8 (linear layers as\n"
          "F8_E4M3 with weight_scale_inv, as DeepSeek-V3 is released) or fp8-dequantized (the "
          "same\n"
          "values decoded into --dtype); empty: random float weights")
      .opt("fp8-block", "128x128", "FP8 weight_block_size, ROWSxCOLS (COLS even)")
      .opt("config-patch", "",
           "a JSON object merged into the preset's config.json before the weights are drawn,\n"
           "e.g. '{\"num_experts\": 512, \"num_experts_per_tok\": 10}'");
  if (!a.parse(argc, argv)) return 0;
  MakeModelOptions o;
  o.arch = a.str("arch");
  o.preset = a.str("preset");
  o.seed = uint64_t(a.integer("seed"));
  std::string dt = a.str("dtype");
  if (dt == "bf16")
    o.dtype = DType::BF16;
  else if (dt == "f32")
    o.dtype = DType::F32;
  else
    throw Error("r3 make-model: --dtype must be bf16 or f32, got \"" + dt + "\"");
  o.out = a.str("out");
  o.tokenizer = a.str("tokenizer");
  o.quant = a.str("quant");
  o.config_patch = a.str("config-patch");
  const std::string block = a.str("fp8-block");
  if (std::sscanf(block.c_str(), "%dx%d", &o.fp8_block[0], &o.fp8_block[1]) != 2)
    throw Error("r3 make-model: --fp8-block must be ROWSxCOLS, got \"" + block + "\"");
  if (o.out.empty()) throw Error("r3 make-model: --out DIR is required");
  make_model(o);
  return 0;
}

}  // namespace r3::cli
