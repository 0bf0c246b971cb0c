// r3 bench's startup entry (issue 42): start to first token of a fresh engine (one prompt, one
// token, in a child process so nothing else this process holds is counted) against reading the
// checkpoint files once from the page cache and first-touching as many fresh bytes as the child
// kept resident, all measured in the same run; and the child's peak resident memory against the
// checkpoint's bytes plus its KV pool.
#pragma once
#include <nlohmann/json.hpp>

#include "engine/engine.h"

namespace r3::cli {

// Runs `reps` children; prints the best of each figure and returns them as JSON. Call it while
// this process has no other threads (it forks).
nlohmann::json bench_startup(const EngineConfig& cfg, int reps);

}  // namespace r3::cli
