// C1 + C4: capture slots and their hand-off. A capture slot holds one step's routes
// [max tokens in a step incl. padding, L_moe, K]; the MoE layer writes it right after top-k
// (capture() is called inside the MoE function itself, so no execution path can skip it). Slots
// circulate through a bounded ring: the forward thread takes a free one per step, the route
// manager hands it back after committing, and a forward that finds no free slot waits (counted).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace r3 {

struct CaptureSlot {
  uint64_t iter = 0;
  int max_tokens = 0, layers = 0, k = 0;
  std::vector<int16_t> data;   // [max_tokens, layers, k]
  std::vector<float> weights;  // [max_tokens, layers, k]: each chosen expert's gate weight

  void capture(int moe_layer, int token, const int16_t* ids, const float* gate_weights) {
    const size_t at = (size_t(token) * size_t(layers) + size_t(moe_layer)) * size_t(k);
    std::memcpy(data.data() + at, ids, size_t(k) * sizeof(int16_t));
    std::memcpy(weights.data() + at, gate_weights, size_t(k) * sizeof(float));
  }
  const int16_t* row(int token) const {
    return data.data() + size_t(token) * size_t(layers) * size_t(k);
  }
  const float* weight_row(int token) const {
    return weights.data() + size_t(token) * size_t(layers) * size_t(k);
  }
};

class RouteCapturer {
 public:
  RouteCapturer(int ring_size, int max_tokens, int layers, int k);
  CaptureSlot* acquire(uint64_t iter);  // waits while every slot is in use
  void release(CaptureSlot* slot);
  uint64_t waits() const { return waits_; }
  int max_tokens() const { return max_tokens_; }

 private:
  int max_tokens_;
  std::vector<CaptureSlot> slots_;
  std::vector<CaptureSlot*> free_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t waits_ = 0;
};

}  // namespace r3
