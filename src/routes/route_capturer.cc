#include "routes/route_capturer.h"

namespace r3 {

RouteCapturer::RouteCapturer(int ring_size, int max_tokens, int layers, int k)
    : max_tokens_(max_tokens), slots_(size_t(ring_size)) {
  for (auto& s : slots_) {
    s.max_tokens = max_tokens;
    s.layers = layers;
    s.k = k;
    s.data.assign(size_t(max_tokens) * size_t(layers) * size_t(k), -1);
    s.weights.assign(s.data.size(), 0.f);
    free_.push_back(&s);
  }
}

CaptureSlot* RouteCapturer::acquire(uint64_t iter) {
  std::unique_lock<std::mutex> lock(mu_);
  if (free_.empty()) {
    ++waits_;
    cv_.wait(lock, [this] { return !free_.empty(); });
  }
  CaptureSlot* s = free_.back();
  free_.pop_back();
  s->iter = iter;
  return s;
}

void RouteCapturer::release(CaptureSlot* slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(slot);
  }
  cv_.notify_one();
}

}  // namespace r3
