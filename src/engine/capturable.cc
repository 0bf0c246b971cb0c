#include "engine/capturable.h"

#include <algorithm>

#include "core/error.h"
#include "engine/engine.h"

namespace r3 {

void assert_capturable(const EngineConfig& cfg, const ModelConfig& model, int capture_slot_tokens) {
  if (!cfg.enable_return_routed_experts) return;
  if (model.num_experts > 32767)
    throw Error("enable_return_routed_experts: " + std::to_string(model.num_experts) +
                " experts do not fit the int16 route contract");
  if (model.top_k > model.num_experts)
    throw Error("enable_return_routed_experts: top_k exceeds the number of experts");
  int largest_step = cfg.max_num_batched_tokens;
  for (int b : cfg.decode_buckets) largest_step = std::max(largest_step, b);
  if (largest_step > capture_slot_tokens)
    throw Error("enable_return_routed_experts: a step may hold " + std::to_string(largest_step) +
                " tokens (max_num_batched_tokens / decode_buckets) but capture slots hold " +
                std::to_string(capture_slot_tokens));
}

}  // namespace r3
