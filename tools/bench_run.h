// One timed run of an `r3 bench` entry on an engine: the entry's prompts, the untimed prefill of
// a decode entry, then engine steps until every request has finished, and the figures of the
// timed span. A run is stepped from outside (TimedRun::step), so two engines can take turns one
// step each (run_entries_paired): drift of the machine over a long entry then falls on both runs
// alike instead of on whichever ran second.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "engine/engine.h"

namespace r3::cli {

struct Entry {
  std::string name;
  int requests, prompt_len, shared_prefix, max_tokens;
  enum Measure { Decode, Prefill, Total } measure;
  // A workload whose drafts can be right (speculative decoding's entries): each prompt is one
  // 32-token stretch repeated, sampled greedily, so the output can copy what came before.
  bool copyable = false;
};

// A shared-prefix entry draws each prompt's first `shared_prefix` tokens from this many bases
// (request r from base r % kPrefixBases).
constexpr int kPrefixBases = 4;

struct Timing {
  double tokens_per_s = 0, weight_gb_per_s = 0, gflops = 0, kv_gb_per_s = 0;
  double attention_kv_gb_per_s = 0;  // the same KV bytes over attention's own time
  double route_fraction = 0;         // of the timed span, spent committing and assembling routes
  double deltanet_fraction = 0;      // of the timed span, in Gated DeltaNet blocks (hybrids)
  uint64_t preemptions = 0;          // during the run: the KV pool was too small for the entry
  double seconds = 0;                // the timed span
};

// Per-token matmul FLOPs of the model (2 per weight element a token touches) plus attention at
// an average context of `avg_ctx` positions (capped at a sliding layer's window).
double flops_per_token(const ModelConfig& c, double avg_ctx);

// KV-cache bytes attention reads per token at a context of `ctx` positions: every layer's cached
// row (K and V, or MLA's latent) per position it attends, a sliding layer's at most its window.
double kv_bytes_per_token(const ModelConfig& c, double ctx, double element_bytes);

// KV tokens the entry holds at its peak with every request in flight: the shared prefixes once
// per base when the prefix cache shares them, and a block of slack per request.
int64_t kv_tokens_needed(const Entry& en, bool prefix_caching, int block_size);

class TimedRun {
 public:
  // Adds the entry's requests to `e`. `run` salts the prompts: every run gets its own, so no run
  // finds the previous run's prompts in the prefix cache (prefixes are shared only within a run,
  // as the entry intends). Decode entries are the exception: they prefill their prompts untimed
  // here, one token each, so every run takes the same prompts, and after an engine's first run
  // that prefill is a cache hit instead of minutes of prefill (decode_b32_ctx8k); the modes then
  // decode one workload.
  TimedRun(Engine& e, const Entry& en, bool ask_routes, uint64_t run);
  // One engine step; false once every request has finished. Only the steps of the timed span
  // count: all of them, or for a decode entry those after every request has its first token.
  bool step();
  Timing timing() const;

 private:
  Engine& e_;
  Entry en_;
  bool timing_started_;
  EngineStats start_, before_;  // stats when the timed span began; when the run began
  double seconds_ = 0;          // the timed span's steps
};

Timing run_entry(Engine& e, const Entry& en, bool ask_routes, uint64_t run);

// The same entry on two engines, one step each in turn until both have finished; each run's
// time is the sum of its own steps. Both take the same prompts (their prefix caches are
// separate), so the two runs do the same work.
std::pair<Timing, Timing> run_entries_paired(Engine& a, bool a_asks_routes, Engine& b,
                                             bool b_asks_routes, const Entry& en, uint64_t run);

}  // namespace r3::cli
