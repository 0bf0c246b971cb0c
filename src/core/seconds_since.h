// Wall time since a steady_clock reading, in seconds: the one spelling of the timers behind
// start-up figures, latency counters and benches. (The kernels' timing code keeps its own: an
// inline function shared with baseline code must not be compiled under a kernel set's flags.)
#pragma once
#include <chrono>

namespace r3 {

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace r3
