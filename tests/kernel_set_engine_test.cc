// The whole engine gives the portable kernel set's bits under every set this CPU runs: `r3
// generate` of one seeded batch (prompts of mixed lengths, chunked prefill, greedy and sampled
// requests, routes) on every family and stored format, each set in its own process (R3_KERNELS
// is read once per process), output files compared byte for byte. kernel_set_test.cc checks
// each kernel against the portable one; this checks that nothing the engine runs escapes that
// check, which lets `make variants` run only the kernel and engine-bitwise tests under each set.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/kernel_set.h"
#include "test_models.h"

namespace r3::testing {
namespace {

namespace fs = std::filesystem;

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Prompts of 1 to 40 tokens, half greedy, half sampled with a seed, every one asking for routes.
std::string random_requests(uint64_t seed, int vocab) {
  std::mt19937_64 rng(seed);
  std::string lines;
  for (int r = 0; r < 6; ++r) {
    nlohmann::json j;
    std::vector<int> prompt(size_t(1 + rng() % 40));
    for (int& t : prompt) t = int(3 + rng() % uint64_t(vocab - 3));
    j["prompt_token_ids"] = prompt;
    j["max_tokens"] = 1 + int(rng() % 8);
    j["ignore_eos"] = true;
    j["temperature"] = r % 2 ? 0.8 : 0.0;
    j["seed"] = int(rng() % 1000);
    j["return_routed_experts"] = true;
    lines += j.dump() + "\n";
  }
  return lines;
}

TEST(KernelSetEngine, EverySetGivesThePortableBits) {
  const auto sets = kernels::supported_kernel_sets();
  if (sets.size() < 2) GTEST_SKIP() << "this CPU runs only the portable set";
  const fs::path dir = fs::temp_directory_path() / ("r3_kernel_sets_" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::vector<std::string> models = kAllArchs;
  for (const char* quantized : {"gpt_oss_mxfp4", "qwen3_moe_fp8", "deepseek_v3_fp8"})
    models.push_back(quantized);
  uint64_t seed = 7;
  for (const std::string& arch : models) {
    SCOPED_TRACE(arch);
    const std::string model = test_model(arch);
    const nlohmann::json config = nlohmann::json::parse(read_all(fs::path(model) / "config.json"));
    const int vocab = config.value("text_config", config)["vocab_size"];  // a VL release's decoder
    std::ofstream(dir / "in.jsonl") << random_requests(++seed, vocab);
    std::string want, want_file;
    for (auto it = sets.rbegin(); it != sets.rend(); ++it) {  // portable first
      const std::string set = (*it)->name, out = (dir / (arch + "_" + set + ".jsonl")).string();
      // A 16-token step budget chunks the longer prompts' prefill and mixes it with decodes.
      const std::string cmd =
          "R3_KERNELS=" + set + " " + R3_BINARY + " generate --model " + model + " --input " +
          (dir / "in.jsonl").string() + " --output " + out +
          " --enable-return-routed-experts --max-num-batched-tokens 16 --threads 2 --no-progress" +
          " > " + (dir / "log").string() + " 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << read_all(dir / "log");
      const std::string got = read_all(out);
      ASSERT_FALSE(got.empty()) << set;
      if (want.empty()) {
        want = got;
        want_file = out;
      } else {
        EXPECT_TRUE(got == want) << set << " differs from portable: diff " << want_file << " "
                                 << out;
      }
    }
  }
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace r3::testing
