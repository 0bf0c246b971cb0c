// What this machine can do, measured in the same run as the benchmarks that are compared to it:
// streaming read bandwidth (all threads reading a buffer much larger than the caches) and the
// arithmetic peak of the widest bf16 dot-product instruction (a register-resident loop).
#pragma once
#include <string>

#include "core/thread_pool.h"

namespace r3::kernels {

struct MachineLimits {
  double read_gb_per_s = 0;     // streaming read bandwidth, all threads
  double peak_gflops = 0;       // bf16 dot-product peak (fp32 FMA peak where bf16 is absent)
  std::string peak_instruction;  // which instruction the peak loop ran
};

double measure_read_bandwidth(ThreadPool* pool, size_t bytes = size_t(1) << 30);
double measure_peak_gflops(ThreadPool* pool, std::string* instruction);
MachineLimits measure_machine(ThreadPool* pool);

}  // namespace r3::kernels
