// r3: the command-line front end. One verb per file (cmd_*.cc).
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "commands.h"
#include "core/error.h"

namespace {

struct Verb {
  const char* name;
  int (*fn)(int, char**);
  const char* help;
};

const Verb kVerbs[] = {
    {"make-model", r3::cli::cmd_make_model, "write a seeded random MoE checkpoint (HF layout)"},
    {"generate", r3::cli::cmd_generate, "generate from a JSONL file of prompts, with routes"},
    {"serve", r3::cli::cmd_serve, "HTTP server: OpenAI-style /v1/completions, SGLang-style /generate"},
    {"bench", r3::cli::cmd_bench, "benchmark suite: tokens/s, bandwidth and FLOP/s, routes on vs off"},
    {"align", r3::cli::cmd_align, "multi-turn rollouts -> staging -> replay: train/inference mismatch"},
    {"tokenize", r3::cli::cmd_tokenize, "encode text / decode ids with a Hugging Face tokenizer.json"},
};

void usage() {
  std::printf("usage: r3 <verb> [options]   (r3 <verb> --help for the verb's options)\n\nverbs:\n");
  for (auto& v : kVerbs) std::printf("  %-12s %s\n", v.name, v.help);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  for (auto& v : kVerbs) {
    if (std::strcmp(argv[1], v.name) != 0) continue;
    try {
      return v.fn(argc - 2, argv + 2);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "error: unknown verb \"%s\"\n", argv[1]);
  usage();
  return 2;
}
