// What this machine can do, measured in the same run as the benchmarks that are compared to it:
// streaming read bandwidth (all threads reading a buffer much larger than the caches) and the
// arithmetic peak of the widest bf16 dot-product instruction (a register-resident loop), and
// the fp32 FMA peak beside it (the instruction the bf16 matmul actually runs, see matmul.cc).
#pragma once
#include <string>

#include "core/thread_pool.h"

namespace r3::kernels {

struct MachineLimits {
  std::string kernels;          // the kernel set measured and run (kernel_set.h)
  double read_gb_per_s = 0;     // streaming read bandwidth, all threads
  double peak_gflops = 0;       // bf16 dot-product peak (fp32 FMA peak where bf16 is absent)
  std::string peak_instruction;  // which instruction the peak loop ran
  double fma_peak_gflops = 0;   // fp32 FMA peak: the bf16 matmul widens to fp32 and runs on FMA
};

double measure_read_bandwidth(ThreadPool* pool, size_t bytes = size_t(1) << 30);
double measure_peak_gflops(ThreadPool* pool, std::string* instruction);
double measure_fma_peak_gflops(ThreadPool* pool);
MachineLimits measure_machine(ThreadPool* pool);

}  // namespace r3::kernels
