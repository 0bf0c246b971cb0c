// A fixed pool of worker threads running parallel_for over index ranges. Work is split by
// output index (features, experts, tokens), never inside one reduction, so results do not
// depend on the number of threads (DESIGN.md, batch invariance). Workers spin briefly between
// jobs (a forward issues hundreds of small ones) and sleep when the engine is idle.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace r3 {

// A non-owning reference to a callable: unlike std::function it never allocates, so handing
// work to the pool costs nothing on the heap.
template <typename Sig>
class FunctionRef;
template <typename R, typename... A>
class FunctionRef<R(A...)> {
 public:
  template <typename F>
  FunctionRef(F&& f)
      : obj_(const_cast<void*>(static_cast<const void*>(&f))), call_([](void* o, A... a) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(a...);
        }) {}
  R operator()(A... a) const { return call_(obj_, a...); }

 private:
  void* obj_;
  R (*call_)(void*, A...);
};

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // Calls fn(begin, end) on contiguous chunks covering [0, n); the caller thread takes part.
  // A throw from fn on any thread is rethrown here once every thread is done (the caller's
  // first, else a worker's); the other chunks still run.
  void parallel_for(int64_t n, FunctionRef<void(int64_t, int64_t)> fn);
  // Calls fn(i) for every i in [0, n), items handed out one at a time to whichever thread is
  // free (uneven items, e.g. experts with different token counts, stay balanced). Each item
  // must write its own outputs, so the results do not depend on who ran it.
  void parallel_for_each(int64_t n, FunctionRef<void(int64_t)> fn);
  // The same, each thread claiming its next item before it runs the current one and calling
  // ahead(next) first: the next item's data (its weights) can start on its way from memory, so
  // an item does not begin on cold misses.
  void parallel_for_each(int64_t n, FunctionRef<void(int64_t)> fn,
                         FunctionRef<void(int64_t)> ahead);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  const FunctionRef<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  int sleepers_ = 0;
  bool stop_ = false;
  std::exception_ptr worker_error_;  // a worker's throw in the job under way (guarded by mu_)
  std::atomic<bool> worker_failed_{false};  // worker_error_ is set
};

}  // namespace r3
