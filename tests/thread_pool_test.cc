// ThreadPool: every index runs exactly once, whoever runs it; parallel_for_each with a look-ahead
// calls ahead(j) on the thread that will run j, before it runs the item before j (so j's data
// moves while that item computes), for every item but each thread's first.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace r3 {
namespace {

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  ThreadPool pool(3);
  for (int64_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
    pool.parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) runs[size_t(i)].fetch_add(1);
    });
    for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  }
}

TEST(ThreadPool, ParallelForEachRunsEveryItemOnce) {
  ThreadPool pool(2);
  for (int64_t n : {0, 1, 3, 500}) {
    std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
    pool.parallel_for_each(n, [&](int64_t i) { runs[size_t(i)].fetch_add(1); });
    for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  }
}

// A throw from any thread's chunk reaches the caller, after every other chunk has run (fn lives
// on the caller's stack); the pool keeps working afterwards. Without this a worker's throw ended
// the process (std::terminate), and a caller's left the workers running a destroyed fn.
TEST(ThreadPool, AThrowOnAnyThreadIsRethrownToTheCallerOnceAllAreDone) {
  ThreadPool pool(3);
  for (int64_t thrower = 0; thrower < 3; ++thrower) {  // chunk 0 is the caller's
    std::vector<std::atomic<int>> runs(3);
    try {
      pool.parallel_for(3, [&](int64_t b, int64_t) {
        if (b == thrower) throw std::runtime_error("chunk " + std::to_string(b));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        runs[size_t(b)].fetch_add(1);
      });
      ADD_FAILURE() << "no throw reached the caller";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "chunk " + std::to_string(thrower));
    }
    for (int64_t b = 0; b < 3; ++b) EXPECT_EQ(runs[size_t(b)].load(), b == thrower ? 0 : 1) << b;
  }
  std::atomic<int> items{0};
  pool.parallel_for_each(100, [&](int64_t) { items.fetch_add(1); });
  EXPECT_EQ(items.load(), 100);
}

TEST(ThreadPool, LookAheadComesBeforeItsItemOnTheSameThread) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 2, 5, 300}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n)), aheads(static_cast<size_t>(n));
      std::vector<std::thread::id> ahead_by(static_cast<size_t>(n));
      std::atomic<int> misordered{0}, other_thread{0}, late{0};
      std::mutex mu;
      std::map<std::thread::id, int64_t>
          last_ahead;  // per thread: the item it looked ahead to last
      pool.parallel_for_each(
          n,
          [&](int64_t i) {
            runs[size_t(i)].fetch_add(1);
            if (aheads[size_t(i)].load() == 1 && ahead_by[size_t(i)] != std::this_thread::get_id())
              ++other_thread;
            // The look-ahead to a thread's next item comes before this one runs: only a thread's
            // last item finds its own look-ahead the latest.
            std::lock_guard<std::mutex> lock(mu);
            auto it = last_ahead.find(std::this_thread::get_id());
            if (it != last_ahead.end() && it->second == i) ++late;
          },
          [&](int64_t j) {
            if (runs[size_t(j)].load() != 0) ++misordered;
            ahead_by[size_t(j)] = std::this_thread::get_id();
            aheads[size_t(j)].fetch_add(1);
            std::lock_guard<std::mutex> lock(mu);
            last_ahead[std::this_thread::get_id()] = j;
          });
      int looked_ahead = 0;
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(runs[size_t(i)].load(), 1) << "item " << i;
        EXPECT_LE(aheads[size_t(i)].load(), 1) << "item " << i;
        looked_ahead += aheads[size_t(i)].load();
      }
      EXPECT_EQ(misordered.load(), 0);
      EXPECT_EQ(other_thread.load(), 0);
      EXPECT_LE(late.load(), pool.size()) << threads << " threads, " << n << " items";
      // Only a thread's first item goes without a look-ahead.
      EXPECT_GE(looked_ahead, int(n) - pool.size()) << threads << " threads, " << n << " items";
    }
  }
}

}  // namespace
}  // namespace r3
