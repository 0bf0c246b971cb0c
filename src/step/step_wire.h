// A step plan and its token ids as bytes, for the ranks of an expert-parallel group that compute
// a step rank 0 planned (engine/expert_exchange.h). The plan's structs are plain data, copied
// whole; the reader checks every length against the bytes it has.
#pragma once
#include <cstdint>
#include <vector>

#include "step/step_plan.h"

namespace r3 {

void write_step(const StepPlan& plan, const int* token_ids, std::vector<uint8_t>& bytes);
// Throws r3::Error when `bytes` is not one whole write_step message.
void read_step(const std::vector<uint8_t>& bytes, StepPlan& plan, std::vector<int>& token_ids);

}  // namespace r3
