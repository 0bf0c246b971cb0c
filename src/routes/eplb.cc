#include "routes/eplb.h"

#include <algorithm>
#include <numeric>

namespace r3 {

EplbMap::EplbMap(int num_moe_layers, int num_experts, int redundant,
                 const std::vector<std::vector<uint64_t>>& load)
    : num_experts_(num_experts), redundant_(std::min(redundant, num_experts)) {
  replicas_.resize(size_t(num_moe_layers));
  logical_.resize(size_t(num_moe_layers));
  for (int l = 0; l < num_moe_layers; ++l) {
    auto& rep = replicas_[size_t(l)];
    rep.resize(size_t(num_experts));
    auto& lg = logical_[size_t(l)];
    for (int e = 0; e < num_experts; ++e) {
      rep[size_t(e)].push_back(e);
      lg.push_back(e);
    }
    std::vector<int> order(static_cast<size_t>(num_experts));
    std::iota(order.begin(), order.end(), 0);
    const std::vector<uint64_t>* ld = size_t(l) < load.size() ? &load[size_t(l)] : nullptr;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      uint64_t la = ld && size_t(a) < ld->size() ? (*ld)[size_t(a)] : 0;
      uint64_t lb = ld && size_t(b) < ld->size() ? (*ld)[size_t(b)] : 0;
      return la > lb;
    });
    for (int r = 0; r < redundant_; ++r) {
      int e = order[size_t(r)];
      rep[size_t(e)].push_back(num_experts + r);
      lg.push_back(e);
    }
  }
}

int EplbMap::physical(int layer, int logical, int nth) const {
  if (!enabled()) return logical;
  const auto& rep = replicas_[size_t(layer)][size_t(logical)];
  return rep[size_t(nth) % rep.size()];
}

int EplbMap::logical_of(int layer, int physical) const {
  if (!enabled()) return physical;
  return logical_[size_t(layer)][size_t(physical)];
}

}  // namespace r3
