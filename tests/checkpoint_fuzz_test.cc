// A bounded, seeded run of the checkpoint-reader fuzz target (fuzz/checkpoint_target.h; the
// libFuzzer run is `scripts/fuzz.sh checkpoint`): mutations of the seed corpus in
// fuzz/corpus-checkpoint — byte flips, inserted and deleted runs, splices, JSON tokens — must all
// end in r3::Error or a clean parse.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "fuzz/checkpoint_target.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> seeds() {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(fs::path(R3_SOURCE_DIR) / "fuzz" / "corpus-checkpoint")) {
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    out.push_back(ss.str());
  }
  return out;
}

TEST(CheckpointFuzz, SeedCorpusIsRead) {
  const auto s = seeds();
  ASSERT_GE(s.size(), 5u);
  for (const std::string& x : s)
    fuzz_checkpoint_readers(reinterpret_cast<const uint8_t*>(x.data()), x.size());
}

TEST(CheckpointFuzz, SeededMutations) {
  const auto corpus = seeds();
  std::mt19937_64 rng(0xc4ec);
  auto uni = [&](size_t lo, size_t hi) {
    return std::uniform_int_distribution<size_t>(lo, hi)(rng);
  };
  const char* tokens[] = {"{",
                          "}",
                          "[",
                          "]",
                          ",",
                          ":",
                          "\"",
                          "-1",
                          "0",
                          "1e308",
                          "18446744073709551616",
                          "\"F32\"",
                          "\"BF16\"",
                          "\"dtype\"",
                          "\"shape\"",
                          "\"data_offsets\"",
                          "null",
                          "\"__metadata__\"",
                          "\"architectures\"",
                          "\"num_experts\"",
                          "\xef\xbb\xbf",
                          " "};
  const int kRuns = 20000;
  for (int run = 0; run < kRuns; ++run) {
    std::string s = corpus[uni(0, corpus.size() - 1)];
    const size_t edits = uni(1, 4);
    for (size_t e = 0; e < edits && s.size() > 1; ++e) {
      const size_t at = uni(1, s.size() - 1);  // byte 0 chooses the reader: keep it
      switch (uni(0, 4)) {
        case 0:
          s[at] = char(uni(0, 255));
          break;
        case 1:
          s.erase(at, uni(1, std::min<size_t>(16, s.size() - at)));
          break;
        case 2:
          s.insert(at, tokens[uni(0, std::size(tokens) - 1)]);
          break;
        case 3: {
          const std::string& o = corpus[uni(0, corpus.size() - 1)];
          s = s.substr(0, at) + o.substr(std::min(o.size(), uni(1, o.size())));
          break;
        }
        default:
          s.resize(at);
          break;
      }
    }
    fuzz_checkpoint_readers(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
}

}  // namespace
}  // namespace r3
