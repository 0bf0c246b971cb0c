// The MoE block of the runner: router and capture, EPLB remap, experts grouped by token, combine
// in router order, shared experts (through the dense MLP block, dense_block.cc).
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/dtype.h"
#include "engine/model_runner.h"
#include "engine/router.h"
#include "kernels/exp.h"
#include "kernels/matmul.h"

namespace r3 {

using kernels::Activations;
using kernels::matmul;
using kernels::matmul_rows;
using kernels::round_to_bf16;

namespace {

struct WorkItem {
  int group, begin, end;
};

// Runs `rows` of an expert's weight for every group in [first, last): items are (group, row block)
// pairs handed to whichever core is free, so both cores stay busy even when one expert has few
// rows or the groups' token counts differ. Each core claims its next item before it runs the
// current one and calls prefetch(next) first, which starts that item's weights towards L2: the
// next item then begins on L2 hits, not on memory misses. Each item writes its own outputs, so
// who runs it changes no bit.
template <typename Fn, typename Prefetch>
void for_group_rows(ThreadPool* pool, const std::vector<int>& offsets, int first, int last,
                    int rows, Fn fn, Prefetch prefetch) {
  // thread_local names are not captured by lambdas: hand the workers a plain reference.
  thread_local std::vector<WorkItem> items_storage;
  std::vector<WorkItem>& items = items_storage;
  items.clear();
  const int block = 256;  // rows per item: long contiguous weight streams per core (64-row items
                          // measured ~5% slower)
  for (int g = first; g < last; ++g)
    if (offsets[size_t(g + 1)] > offsets[size_t(g)])
      for (int r = 0; r < rows; r += block) items.push_back({g, r, std::min(rows, r + block)});
  pool->parallel_for_each(
      int64_t(items.size()), [&](int64_t i) { fn(items[size_t(i)]); },
      [&](int64_t i) { prefetch(items[size_t(i)]); });
}

}  // namespace

// MoE by grouping tokens per expert (llama.cpp's mul_mat_id shape): router top-k and capture,
// remap to physical experts (EPLB), list each expert's tokens (read in place, no gathered
// copy), gate/up with SiLU, down, then each token sums its k expert outputs in router order.
// Expert parallelism: this rank runs its own physical experts' groups only, and the exchange
// brings the other ranks' rows before the sum.
void ModelRunner::moe(const LayerWeights& L, int moe_layer, int T, float* out, CaptureSlot* slot,
                      int num_real) {
  const ModelConfig& c = config();
  const int H = c.hidden_size, E = c.num_experts, K = c.top_k, I = c.moe_intermediate_size;
  matmul({h_.data(), hb_.data(), T}, L.router, probs_.data(), pool_);  // router logits [T, E]
  const float* bias = nullptr;
  if (!L.router_bias.empty()) {
    router_bias_.resize(size_t(E));
    for (int e = 0; e < E; ++e) router_bias_[size_t(e)] = L.router_bias.at(e);
    bias = router_bias_.data();
  }
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> route_scratch;  // [E], for the sigmoid router
    for (int64_t t = t0; t < t1; ++t) {
      float* scores = probs_.data() + size_t(t) * E;
      // A NaN score would lose every comparison and quietly route around itself: instead the
      // token's expert weights become NaN, so its hidden state and logits are NaN and the
      // request fails on its non-finite logits (its routes are never returned as if valid).
      const bool nan = std::any_of(scores, scores + E, [](float x) { return std::isnan(x); });
      route_token(c.router, scores, bias, E, K, route_ids_.data() + size_t(t) * K,
                  route_w_.data() + size_t(t) * K, route_scratch);
      if (nan)
        std::fill_n(route_w_.data() + size_t(t) * K, K, std::numeric_limits<float>::quiet_NaN());
      if (slot)
        slot->capture(moe_layer, int(t), route_ids_.data() + size_t(t) * K,  // before any remap
                      route_w_.data() + size_t(t) * K);
    }
  });
  // Logical -> physical, counting sort by physical expert.
  const int P = eplb_.enabled() ? eplb_.num_physical() : E;
  group_offsets_.assign(size_t(P + 1), 0);
  std::vector<int>& nth_of_logical = nth_of_logical_;
  std::vector<int>& phys = phys_;
  nth_of_logical.assign(size_t(E), 0);
  phys.resize(size_t(T) * K);
  for (int a = 0; a < T * K; ++a) {
    const int e = route_ids_[size_t(a)];
    const int p = eplb_.physical(moe_layer, e, nth_of_logical[size_t(e)]++);
    phys[size_t(a)] = p;
    ++group_offsets_[size_t(p + 1)];
    if (a / K < num_real) {
      load_[size_t(moe_layer)][size_t(e)].fetch_add(1, std::memory_order_relaxed);
      phys_load_[size_t(moe_layer)][size_t(p)].fetch_add(1, std::memory_order_relaxed);
    }
  }
  for (int p = 0; p < P; ++p) group_offsets_[size_t(p + 1)] += group_offsets_[size_t(p)];
  std::vector<int>& fill = fill_;
  fill.assign(group_offsets_.begin(), group_offsets_.end() - 1);
  for (int a = 0; a < T * K; ++a) {
    const int s = fill[size_t(phys[size_t(a)])]++;
    slot_token_[size_t(s)] = a / K;
    slot_of_[size_t(a)] = s;
  }
  const auto [own_begin, own_end] = own_physical(P);
  uint64_t bytes = 0;
  for (int p = own_begin; p < own_end; ++p)
    if (group_offsets_[size_t(p + 1)] > group_offsets_[size_t(p)]) {
      const ExpertWeights& w = L.experts[size_t(eplb_.logical_of(moe_layer, p))];
      bytes += w.gate.nbytes() + w.up.nbytes() + w.down.nbytes();
    }
  weight_bytes_ += bytes + L.router.nbytes();
  auto weights_of = [&](int p) -> const ExpertWeights& {
    return L.experts[size_t(eplb_.logical_of(moe_layer, p))];
  };
  const ExpertActivation& act = c.layers[size_t(moe_layers_[size_t(moe_layer)])].activation;
  for_group_rows(
      pool_, group_offsets_, own_begin, own_end, I,
      [&](const WorkItem& it) {
        const int off = group_offsets_[size_t(it.group)],
                  n = group_offsets_[size_t(it.group + 1)] - off;
        const ExpertWeights& w = weights_of(it.group);
        const Activations xg{h_.data(), hb_.data(), n,
                             slot_token_.data() + off};  // the group's tokens in place
        matmul_rows(xg, w.gate, gate_.data() + size_t(off) * I, I, it.begin, it.end);
        matmul_rows(xg, w.up, up_.data() + size_t(off) * I, I, it.begin, it.end);
        // Biases and the gating of the rows just computed, while they are in cache.
        const int len = it.end - it.begin;
        for (int r = off; r < off + n; ++r) {
          const size_t at = size_t(r) * I + size_t(it.begin);
          if (!w.gate_bias.empty()) {
            kernels::add_bias(gate_.data() + at, w.gate_bias, it.begin, len);
            kernels::add_bias(up_.data() + at, w.up_bias, it.begin, len);
          }
          if (act.clamped)
            kernels::clamped_swiglu(gate_.data() + at, up_.data() + at, act_.data() + at, len,
                                    act.limit, act.alpha);
          else
            kernels::silu_mul(gate_.data() + at, up_.data() + at, act_.data() + at, len);
          round_to_bf16(act_.data() + at, len, actb_.data() + at);
        }
      },
      [&](const WorkItem& it) {
        const ExpertWeights& w = weights_of(it.group);
        kernels::prefetch_rows_start(w.gate, it.begin, it.end);
        kernels::prefetch_rows_start(w.up, it.begin, it.end);
      });
  for_group_rows(
      pool_, group_offsets_, own_begin, own_end, H,
      [&](const WorkItem& it) {
        const int off = group_offsets_[size_t(it.group)],
                  n = group_offsets_[size_t(it.group + 1)] - off;
        const ExpertWeights& w = weights_of(it.group);
        matmul_rows({act_.data() + size_t(off) * I, actb_.data() + size_t(off) * I, n}, w.down,
                    expert_out_.data() + size_t(off) * H, H, it.begin, it.end);
        if (!w.down_bias.empty())
          for (int r = off; r < off + n; ++r)
            kernels::add_bias(expert_out_.data() + size_t(r) * H + it.begin, w.down_bias, it.begin,
                              it.end - it.begin);
      },
      [&](const WorkItem& it) {
        kernels::prefetch_rows_start(weights_of(it.group).down, it.begin, it.end);
      });
  if (exchange_) exchange_->gather_expert_rows(expert_out_.data(), group_offsets_.data(), P, H);
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + size_t(t) * H;
      for (int j = 0; j < K; ++j) {
        const float w = route_w_[size_t(t) * K + j];
        const float* y = expert_out_.data() + size_t(slot_of_[size_t(t) * K + j]) * H;
        if (j == 0)
          for (int d = 0; d < H; ++d) o[d] = w * y[d];
        else
          for (int d = 0; d < H; ++d) o[d] += w * y[d];
      }
    }
  });
  if (L.shared.gate.empty()) return;
  // Shared experts: one MLP on every token, added after the routed sum (scaled by
  // sigmoid(gate . h) where the layer has a gate).
  dense_ffn(L.shared, T, tmp_.data());
  if (!L.shared_gate.empty()) {
    matmul({h_.data(), hb_.data(), T}, L.shared_gate, shared_gate_.data(), pool_);
    weight_bytes_ += L.shared_gate.nbytes();
    for (int t = 0; t < T; ++t) shared_gate_[size_t(t)] = kernels::sigmoid(shared_gate_[size_t(t)]);
  }
  pool_->parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + size_t(t) * H;
      const float* y = tmp_.data() + size_t(t) * H;
      if (L.shared_gate.empty())
        for (int d = 0; d < H; ++d) o[d] += y[d];
      else
        for (int d = 0; d < H; ++d) o[d] += shared_gate_[size_t(t)] * y[d];
    }
  });
}

}  // namespace r3
