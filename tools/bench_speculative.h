// r3 bench's speculative-decoding entries (decode_b1_spec, decode_b8_spec, decode_b32_spec): the
// same decode workload on an engine without speculation and one with it, side by side, routes on
// in both (as RL rollouts run), and the acceptance of the drafts.
#pragma once
#include <nlohmann/json.hpp>

#include "bench_run.h"
#include "engine/engine.h"

namespace r3::cli {

// Runs `en` (a copyable decode entry) reps times on each engine, the two taking turns going
// first; prints one line and returns the figures. `cfg` is the entry's engine configuration;
// speculation is NGRAM with cfg's settings on the one engine and off on the other.
nlohmann::json bench_speculative(const EngineConfig& cfg, const Entry& en, int reps, uint64_t& run);

}  // namespace r3::cli
