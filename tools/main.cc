// r3: the command-line front end. One verb per file (cmd_*.cc).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "commands.h"
#include "core/error.h"
#ifdef R3_HAVE_MPI
#include "parallel/mpi_expert_group.h"
#endif

namespace {

struct Verb {
  const char* name;
  int (*fn)(int, char**);
  const char* help;
};

const Verb kVerbs[] = {
    {"make-model", r3::cli::cmd_make_model, "write a seeded random MoE checkpoint (HF layout)"},
    {"generate", r3::cli::cmd_generate, "generate from a JSONL file of prompts, with routes"},
    {"serve", r3::cli::cmd_serve,
     "HTTP server: OpenAI-style /v1/completions, SGLang-style /generate"},
    {"bench", r3::cli::cmd_bench,
     "benchmark suite: tokens/s, bandwidth and FLOP/s, routes on vs off"},
    {"align", r3::cli::cmd_align,
     "multi-turn rollouts -> staging -> replay: train/inference mismatch"},
    {"tokenize", r3::cli::cmd_tokenize,
     "encode text / decode ids with a Hugging Face tokenizer.json"},
};

void usage() {
  std::printf("usage: r3 <verb> [options]   (r3 <verb> --help for the verb's options)\n\nverbs:\n");
  for (auto& v : kVerbs) std::printf("  %-12s %s\n", v.name, v.help);
}

// The value of --expert-parallel N (or --expert-parallel=N) on the command line; 1 without it.
int expert_parallel_flag(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--expert-parallel") && i + 1 < argc) return std::atoi(argv[i + 1]);
    if (!std::strncmp(argv[i], "--expert-parallel=", 18)) return std::atoi(argv[i] + 18);
  }
  return 1;
}

// Ranks of the MPI job this process belongs to, from the launcher's environment (1 outside one).
int launched_ranks() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Expert parallelism: rank 0 runs the verb below; the other ranks compute for it until it exits.
  const int ep = expert_parallel_flag(argc, argv), launched = launched_ranks();
  if (launched > 1 && ep <= 1) {
    std::fprintf(
        stderr,
        "error: started by mpirun with %d ranks: pass --expert-parallel %d (without it every rank "
        "would run the whole command)\n",
        launched, launched);
    return 2;
  }
#ifndef R3_HAVE_MPI
  if (ep > 1) {
    std::fprintf(
        stderr,
        "error: --expert-parallel needs MPI, and this r3 was built without it (scripts/setup.sh "
        "installs Open MPI; then rebuild)\n");
    return 2;
  }
#else
  std::unique_ptr<r3::MpiExpertGroup> group;
  if (ep > 1) {
    try {
      group = std::make_unique<r3::MpiExpertGroup>(&argc, &argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    }
    if (group->ranks() != ep) {
      group->dissolve();
      if (group->rank() == 0)
        std::fprintf(
            stderr,
            "error: --expert-parallel %d but mpirun started %d ranks (mpirun -np %d r3 ...)\n", ep,
            group->ranks(), ep);
      return 2;
    }
    if (group->rank() != 0) return group->serve();
    r3::MpiExpertGroup* g = group.get();
    r3::set_expert_exchange_opener([g](int ranks, double timeout_s, const std::string& config) {
      return g->open(ranks, timeout_s, config);
    });
  }
#endif
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
