#include "engine/expert_exchange.h"

namespace r3 {

namespace {
ExpertExchangeOpener& opener_storage() {
  static ExpertExchangeOpener opener;
  return opener;
}
}  // namespace

std::vector<std::vector<bool>> held_experts(const EplbMap& map, int num_moe_layers, int num_experts,
                                            int rank, int ranks) {
  const int P = map.enabled() ? map.num_physical() : num_experts;
  std::vector<std::vector<bool>> held(size_t(num_moe_layers),
                                      std::vector<bool>(size_t(num_experts), false));
  for (int l = 0; l < num_moe_layers; ++l)
    for (int p = first_physical(rank, ranks, P); p < first_physical(rank + 1, ranks, P); ++p)
      held[size_t(l)][size_t(map.logical_of(l, p))] = true;
  return held;
}

void set_expert_exchange_opener(ExpertExchangeOpener opener) {
  opener_storage() = std::move(opener);
}
const ExpertExchangeOpener& expert_exchange_opener() { return opener_storage(); }

}  // namespace r3
