#include "engine/expert_exchange.h"

#include "model/checkpoint.h"

namespace r3 {

namespace {
ExpertExchangeOpener& opener_storage() {
  static ExpertExchangeOpener opener;
  return opener;
}
}  // namespace

std::vector<std::vector<bool>> held_experts(const EplbMap& map, int num_moe_layers, int num_experts, int rank,
                                            int ranks) {
  const int P = map.enabled() ? map.num_physical() : num_experts;
  std::vector<std::vector<bool>> held(size_t(num_moe_layers), std::vector<bool>(size_t(num_experts), false));
  for (int l = 0; l < num_moe_layers; ++l)
    for (int p = first_physical(rank, ranks, P); p < first_physical(rank + 1, ranks, P); ++p)
      held[size_t(l)][size_t(map.logical_of(l, p))] = true;
  return held;
}

std::set<std::string> unheld_expert_tensors(const ModelConfig& mc, const EplbMap& map, int rank, int ranks) {
  const auto held = held_experts(map, mc.num_moe_layers(), mc.num_experts, rank, ranks);
  const std::vector<int> layers = mc.moe_layers();
  std::set<std::string> names;
  for (size_t m = 0; m < layers.size(); ++m)
    for (int e = 0; e < mc.num_experts; ++e)
      if (!held[m][size_t(e)])
        for (const char* which : {"gate", "up", "down"}) {
          const std::string w = expert_name(mc, layers[m], e, which);
          names.insert(w);
          names.insert(w + "_scale_inv");
        }
  return names;
}

void set_expert_exchange_opener(ExpertExchangeOpener opener) { opener_storage() = std::move(opener); }
const ExpertExchangeOpener& expert_exchange_opener() { return opener_storage(); }

}  // namespace r3
