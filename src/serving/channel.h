// What the engine loop hands an HTTP call: the latest (cumulative) output of each of the call's
// engine requests ("choices"). The loop publishes, the HTTP thread waits and takes. Outputs are
// cumulative, so a waiting thread that missed some steps loses nothing: it takes the newest
// (streamed route rows, which come as deltas, are joined until taken).
#pragma once
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace r3::serving {

class Channel {
 public:
  // partial: also keep unfinished outputs (streaming); otherwise only finished ones are kept.
  Channel(size_t choices, bool partial)
      : latest_(choices), finished_(choices, false), partial_(partial) {}

  // Loop side.
  void publish(size_t choice, RequestOutput&& o) {
    std::lock_guard<std::mutex> lk(mu_);
    if (finished_[choice] || (!o.finished && !partial_)) return;
    if (o.finished) {
      finished_[choice] = true;
      ++num_finished_;
    }
    // A streamed request's unfinished outputs carry only their new route rows: rows of an
    // output not yet taken go in front of the next one's, so none is lost (a finished output
    // carries every row itself).
    if (!o.finished && o.routed_experts && latest_[choice] && latest_[choice]->routed_experts) {
      RouteArray& earlier = *latest_[choice]->routed_experts;
      earlier.append(*o.routed_experts);
      o.routed_experts = std::move(earlier);
    }
    latest_[choice] = std::move(o);
    ++version_;
    cv_.notify_all();
  }
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) failure_ = why;
    ++version_;
    cv_.notify_all();
  }

  // HTTP side: waits until something was published after *seen (or a failure, or timeout);
  // moves the new outputs into out (nullopt where nothing new). False on timeout.
  bool take(uint64_t& seen, std::chrono::milliseconds timeout,
            std::vector<std::optional<RequestOutput>>& out) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, timeout, [&] { return version_ != seen; })) return false;
    seen = version_;
    out.resize(latest_.size());
    for (size_t i = 0; i < latest_.size(); ++i) {
      out[i] = std::move(latest_[i]);
      latest_[i].reset();
    }
    return true;
  }
  bool all_finished() const {
    std::lock_guard<std::mutex> lk(mu_);
    return num_finished_ == latest_.size();
  }
  std::string failure() const {
    std::lock_guard<std::mutex> lk(mu_);
    return failure_;
  }
  size_t size() const { return latest_.size(); }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::optional<RequestOutput>> latest_;
  std::vector<bool> finished_;
  size_t num_finished_ = 0;
  uint64_t version_ = 0;
  std::string failure_;
  const bool partial_;
};

}  // namespace r3::serving
