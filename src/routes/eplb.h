// Expert-parallel load balancing, in process: R redundant physical replicas of the most loaded
// logical experts. The remap runs after capture (routes stay logical), and a replicated expert's
// tokens are spread over its replicas. Replicas share the logical expert's weights, and each
// token's computation is the same whichever replica runs it, so outputs do not change.
#pragma once
#include <cstdint>
#include <vector>

namespace r3 {

class EplbMap {
 public:
  EplbMap() = default;
  // load: [L_moe][E] token counts (the engine's expert-load statistics); picks, per layer, the
  // R most loaded experts (ties to the lower id) for one extra replica each.
  EplbMap(int num_moe_layers, int num_experts, int redundant,
          const std::vector<std::vector<uint64_t>>& load);
  bool enabled() const { return redundant_ > 0; }
  int num_physical() const { return num_experts_ + redundant_; }
  // Physical expert that runs (layer, logical expert) for the n-th token routed to it this step.
  int physical(int layer, int logical, int nth) const;
  int logical_of(int layer, int physical) const;

 private:
  int num_experts_ = 0, redundant_ = 0;
  std::vector<std::vector<std::vector<int>>> replicas_;  // [layer][logical] -> physical ids
  std::vector<std::vector<int>> logical_;                // [layer][physical] -> logical
};

}  // namespace r3
