// The kernels of one instruction set as a table, and the choice of the table this process runs.
// Every set computes the same bits (dot.h, exp.h); they differ only in speed. The choice is made
// once, on first use: the widest set the CPU supports (cpuid, with the operating system's
// register support), or the one named by the environment variable R3_KERNELS (portable, avx2,
// avx512, avx512bf16), which is refused with an error when the CPU lacks it. The public entry
// points of matmul.h, attention.h, attention_latent.h, ops.h and machine_limits.h call through
// the chosen table.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/attention.h"
#include "kernels/attention_latent.h"
#include "kernels/matmul.h"

namespace r3::kernels {

struct KernelSet {
  const char* name;  // portable, avx2, avx512, avx512bf16
  void (*matmul_rows)(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                      int o_end);
  void (*pack_panels)(const TensorView& W, uint16_t* packed, int64_t panel_begin,
                      int64_t panel_end);
  void (*attend_f32)(const float* q, int head_dim, int pos, float scale, const PagedHead<float>& kv,
                     float* scores, float* out);
  void (*attend_bf16)(const float* q, int head_dim, int pos, float scale,
                      const PagedHead<uint16_t>& kv, float* scores, float* out);
  void (*attend_group_f32)(const float* const* q, const int* pos, int nq, int head_dim, float scale,
                           const PagedHead<float>& kv, float* scores, int score_stride,
                           float* const* out);
  void (*attend_group_bf16)(const float* const* q, const int* pos, int nq, int head_dim,
                            float scale, const PagedHead<uint16_t>& kv, float* scores,
                            int score_stride, float* const* out);
  void (*attend_heads_f32)(const float* q, int h0, int h1, int group, int head_dim, int pos,
                           float scale, const PagedHead<float>& kv, const float* sinks,
                           float* scores, int score_stride, float* out);
  void (*attend_heads_bf16)(const float* q, int h0, int h1, int group, int head_dim, int pos,
                            float scale, const PagedHead<uint16_t>& kv, const float* sinks,
                            float* scores, int score_stride, float* out);
  void (*attend_latent_heads_f32)(const float* q, int h0, int h1, int value_width, int pos,
                                  float scale, const PagedLatent<float>& cache, float* scores,
                                  int score_stride, float* out, size_t out_stride);
  void (*attend_latent_heads_bf16)(const float* q, int h0, int h1, int value_width, int pos,
                                   float scale, const PagedLatent<uint16_t>& cache, float* scores,
                                   int score_stride, float* out, size_t out_stride);
  void (*rms_norm)(const float* x, const TensorView& w, int64_t w_offset, int n, float eps,
                   float* y, float offset);
  void (*add_bias)(float* x, const TensorView& b, int64_t b_offset, int n);
  void (*silu_mul)(const float* gate, const float* up, float* out, int n);
  void (*clamped_swiglu)(const float* gate, const float* up, float* out, int n, float limit,
                         float alpha);
  void (*round_to_bf16)(float* x, int64_t n, uint16_t* bits);
  void (*softmax)(const float* x, int n, float* out);
  double (*sum_f64)(const float* x, int n);
  double (*measure_read_bandwidth)(ThreadPool* pool, size_t bytes);
  double (*measure_peak_gflops)(ThreadPool* pool, std::string* instruction);
  double (*measure_fma_peak_gflops)(ThreadPool* pool);
};

// Each instruction set's table (defined by kernel_set.cc compiled for that set).
const KernelSet& kernel_set_portable();
const KernelSet& kernel_set_avx2();
const KernelSet& kernel_set_avx512();
const KernelSet& kernel_set_avx512bf16();

// The sets this CPU can run, widest first (portable is always last).
std::vector<const KernelSet*> supported_kernel_sets();
// The set R3_KERNELS=`forced` chooses (null or empty: the widest supported); throws r3::Error for
// an unknown name or a set this CPU cannot run.
const KernelSet& choose_kernel_set(const char* forced);
// The set this process runs (chosen on the first call; throws r3::Error when R3_KERNELS names an
// unknown set or one this CPU cannot run, and keeps throwing on later calls).
const KernelSet& active_kernels();

}  // namespace r3::kernels
