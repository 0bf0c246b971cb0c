// Adds the wall time of a scope to a nanosecond counter (a plain or an atomic uint64_t).
#pragma once
#include <chrono>
#include <cstdint>

namespace r3 {

template <typename Counter>
struct ScopedNanoseconds {
  Counter& ns;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~ScopedNanoseconds() {
    ns += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - start)
                       .count());
  }
};
template <typename Counter>
ScopedNanoseconds(Counter&) -> ScopedNanoseconds<Counter>;

}  // namespace r3
