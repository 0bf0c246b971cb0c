// The entry points each instruction set's kernels define, inside r3::kernels::R3_ISA_NS (isa.h).
// Included only by the kernel translation units compiled once per set; everything else calls the
// public declarations of matmul.h, attention.h, attention_latent.h, ops.h and machine_limits.h,
// which forward to the chosen set (kernel_set.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/thread_pool.h"
#include "kernels/attention.h"
#include "kernels/attention_latent.h"
#include "kernels/isa.h"
#include "kernels/matmul.h"

#ifndef R3_ISA_NAME
#error "isa_entry_points.h is for the kernel sources compiled per instruction set (CMakeLists.txt)"
#endif

namespace r3::kernels {
inline namespace R3_ISA_NS {

void matmul_rows(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                 int o_end);
void pack_panels(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end);
template <typename KvT>
void attend(const float* q, int head_dim, int pos, float scale, const PagedHead<KvT>& kv,
            float* scores, float* out);
template <typename KvT>
void attend_group(const float* const* q, const int* pos, int nq, int head_dim, float scale,
                  const PagedHead<KvT>& kv, float* scores, int score_stride, float* const* out);
template <typename KvT>
void attend_heads(const float* q, int h0, int h1, int group, int head_dim, int pos, float scale,
                  const PagedHead<KvT>& kv, const float* sinks, float* scores, int score_stride,
                  float* out);
template <typename KvT>
void attend_latent_heads(const float* q, int h0, int h1, int value_width, int pos, float scale,
                         const PagedLatent<KvT>& cache, float* scores, int score_stride, float* out,
                         size_t out_stride);
void rms_norm(const float* x, const TensorView& w, int64_t w_offset, int n, float eps, float* y,
              float offset);
void add_bias(float* x, const TensorView& b, int64_t b_offset, int n);
void silu_mul(const float* gate, const float* up, float* out, int n);
void clamped_swiglu(const float* gate, const float* up, float* out, int n, float limit,
                    float alpha);
void round_to_bf16(float* x, int64_t n, uint16_t* bits);
void softmax(const float* x, int n, float* out);
double sum_f64(const float* x, int n);
double measure_read_bandwidth(ThreadPool* pool, size_t bytes);
double measure_peak_gflops(ThreadPool* pool, std::string* instruction);
double measure_fma_peak_gflops(ThreadPool* pool);

}  // namespace R3_ISA_NS
}  // namespace r3::kernels
