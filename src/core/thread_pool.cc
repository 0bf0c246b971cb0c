#include "core/thread_pool.h"

#include <exception>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace r3 {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

void run_chunk(const FunctionRef<void(int64_t, int64_t)>& fn, int64_t n, int index, int parts) {
  int64_t begin = n * index / parts, end = n * (index + 1) / parts;
  if (begin < end) fn(begin, end);
}

constexpr int kSpins = 1 << 12;  // some tens of microseconds of pause loops

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    epoch_.fetch_add(1);
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::parallel_for(int64_t n, FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    pending_.store(int(workers_.size()), std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
    wake = sleepers_ > 0;
  }
  if (wake) start_cv_.notify_all();
  // The caller's throw waits for the workers too: fn lives on its stack.
  std::exception_ptr mine;
  try {
    run_chunk(fn, n, 0, size());
  } catch (...) {
    mine = std::current_exception();
  }
  // Spin, then yield: when the machine is oversubscribed a descheduled worker needs the core.
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpins)
      cpu_relax();
    else
      std::this_thread::yield();
  }
  std::exception_ptr theirs;
  if (worker_failed_.load(std::memory_order_acquire)) {  // no lock on the usual path
    std::lock_guard<std::mutex> lock(mu_);
    theirs = std::exchange(worker_error_, nullptr);
    worker_failed_.store(false, std::memory_order_relaxed);
  }
  if (mine) std::rethrow_exception(mine);
  if (theirs) std::rethrow_exception(theirs);
}

void ThreadPool::parallel_for_each(int64_t n, FunctionRef<void(int64_t)> fn) {
  std::atomic<int64_t> next{0};
  auto grab = [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  };
  parallel_for(size(), grab);
}

void ThreadPool::parallel_for_each(int64_t n, FunctionRef<void(int64_t)> fn,
                                   FunctionRef<void(int64_t)> ahead) {
  std::atomic<int64_t> next{0};
  auto grab = [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;) {
      const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
      if (j < n) ahead(j);
      fn(i);
      i = j;
    }
  };
  parallel_for(size(), grab);
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    int spins = 0;
    while (epoch_.load(std::memory_order_acquire) == seen && spins < kSpins) {
      cpu_relax();
      ++spins;
    }
    const FunctionRef<void(int64_t, int64_t)>* job;
    int64_t n;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (epoch_.load(std::memory_order_acquire) == seen) {
        ++sleepers_;
        start_cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        --sleepers_;
      }
      if (stop_) return;
      seen = epoch_.load(std::memory_order_acquire);
      job = job_;
      n = job_n_;
    }
    try {
      run_chunk(*job, n, index, size());
    } catch (...) {  // a throw left here would end the process: the caller rethrows it
      std::lock_guard<std::mutex> lock(mu_);
      if (!worker_error_) worker_error_ = std::current_exception();
      worker_failed_.store(true, std::memory_order_release);
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace r3
