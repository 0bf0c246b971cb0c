// Test checkpoints written by make_model once per process, in the real Hugging Face layout.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "model/families.h"
#include "model/make_model.h"

namespace r3::testing {

// Every architecture r3 implements (the family registry, model/families.h), for tests that run
// on each: a new family's row puts it under every such test.
inline const std::vector<std::string> kAllArchs = [] {
  std::vector<std::string> names;
  for (const Family& f : families()) names.push_back(f.name);
  return names;
}();

// Hybrids (Gated DeltaNet layers with a recurrent state): the engine runs them without prefix
// caching (no state snapshots yet), so tests of prefix hits expect none there.
inline bool is_hybrid(const std::string& arch) {
  return arch.rfind("qwen3_next", 0) == 0 || arch.rfind("qwen3_5_moe", 0) == 0;
}

// `arch` may carry a layout suffix: "gpt_oss_mxfp4" (MXFP4 experts, as released) or
// "gpt_oss_mxfp4_dequantized" (the same weights decoded into the bf16 layout); "<arch>_fp8"
// (block-scaled FP8 linear layers) or "<arch>_fp8_dequantized". The FP8 test block, 32 x 48,
// is uneven so that rows and columns end in partial blocks and a swap of the two shows.
inline std::string test_model(const std::string& arch, const std::string& preset = "tiny",
                              uint64_t seed = 0, DType dtype = DType::BF16) {
  static std::map<std::string, std::string> made;
  const std::string key =
      arch + "_" + preset + "_" + std::to_string(seed) + "_" + dtype_name(dtype);
  auto it = made.find(key);
  if (it != made.end()) return it->second;
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("r3_models_" + std::to_string(getpid())) / key)
          .string();
  MakeModelOptions o;
  o.arch = arch;
  for (const char* quant : {"_mxfp4_dequantized", "_mxfp4", "_fp8_dequantized", "_fp8"}) {
    const size_t at = arch.find(quant);
    if (at != std::string::npos && o.quant.empty()) {
      o.arch = arch.substr(0, at);
      o.quant = quant + 1;
      if (o.quant.find('_') != std::string::npos) o.quant.replace(o.quant.find('_'), 1, "-");
    }
  }
  o.fp8_block[0] = 32;
  o.fp8_block[1] = 48;
  o.preset = preset;
  o.seed = seed;
  o.dtype = dtype;
  o.out = dir;
  make_model(o);
  return made[key] = dir;
}

// A copy of the checkpoint in `src` that a test may damage, under a folder of this process's
// named by `suite`; the folder's earlier copy of the same name is replaced.
inline std::string copy_test_model(const std::string& src, const std::string& suite,
                                   const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path dst =
      fs::temp_directory_path() / ("r3_" + suite + "_" + std::to_string(::getpid())) / name;
  fs::remove_all(dst);
  fs::create_directories(dst.parent_path());
  fs::copy(src, dst, fs::copy_options::recursive);
  return dst.string();
}

}  // namespace r3::testing
