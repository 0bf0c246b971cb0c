// What this machine can do, measured in the same run as the benchmarks that are compared to it:
// streaming read bandwidth (all threads reading a buffer much larger than the caches) and the
// bf16 dot-product peak (register-resident loops): the faster of the widest bf16 dot-product
// instruction and fp32 FMA on widened bf16, the two the bf16 tiles choose between
// (tile_choice.h); the fp32 FMA peak beside it (attention and f32 weights run on FMA).
#pragma once
#include <string>

#include "core/thread_pool.h"

namespace r3::kernels {

struct MachineLimits {
  std::string kernels;           // the kernel set measured and run (kernel_set.h)
  double read_gb_per_s = 0;      // streaming read bandwidth, all threads
  double peak_gflops = 0;        // bf16 dot-product peak: vdpbf16ps or FMA, whichever is faster
  std::string peak_instruction;  // which instruction the peak loop ran
  double fma_peak_gflops = 0;    // fp32 FMA peak: attention, f32 weights and the bf16 fma tiles
};

double measure_read_bandwidth(ThreadPool* pool, size_t bytes = size_t(1) << 30);
double measure_peak_gflops(ThreadPool* pool, std::string* instruction);
double measure_fma_peak_gflops(ThreadPool* pool);
// The bf16 tiles run vdpbf16ps or fma on widened bf16 with the same bits (tile_choice.h), so the
// bf16 peak is the faster one's: where the CPU issues vdpbf16ps at half the FMA rate (Sapphire
// Rapids), the FMA peak replaces it, and peak_instruction says so with the figure it replaced.
void take_faster_bf16_peak(MachineLimits& m);
MachineLimits measure_machine(ThreadPool* pool);

}  // namespace r3::kernels
