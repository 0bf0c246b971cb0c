// A fixed pool of worker threads running parallel_for over index ranges. Work is split by
// output index (features, experts, tokens), never inside one reduction, so results do not
// depend on the number of threads (DESIGN.md, batch invariance). Workers spin briefly between
// jobs (a forward issues hundreds of small ones) and sleep when the engine is idle.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace r3 {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // Calls fn(begin, end) on contiguous chunks covering [0, n); the caller thread takes part.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  int sleepers_ = 0;
  bool stop_ = false;
};

}  // namespace r3
