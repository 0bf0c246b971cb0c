// The public kernel entry points (matmul.h, attention.h, ops.h, machine_limits.h), forwarding to
// the instruction set chosen for this process (kernel_set.h).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "kernels/kernel_set.h"
#include "kernels/machine_limits.h"
#include "kernels/ops.h"

namespace r3::kernels {

namespace {

// What the set's instructions need: AVX-512 Foundation plus the byte/word, vector-length and
// doubleword extensions the tiles use (Skylake-SP and later); the avx512bf16 set also VBMI's
// byte permutes (the FP8 tables: Sapphire Rapids, Zen 4 and later). __builtin_cpu_supports also
// checks that the operating system saves the wide registers.
bool cpu_runs(const KernelSet& set) {
  const std::string name = set.name;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (name == "avx512bf16")
    return avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  if (name == "avx512") return avx512;
  if (name == "avx2") return avx2;
  return true;
}

// Every set, widest first.
std::vector<const KernelSet*> all_sets() {
  return {&kernel_set_avx512bf16(), &kernel_set_avx512(), &kernel_set_avx2(),
          &kernel_set_portable()};
}

std::string names_of(const std::vector<const KernelSet*>& sets) {
  std::string s;
  for (const KernelSet* k : sets) s += std::string(s.empty() ? "" : ", ") + k->name;
  return s;
}

}  // namespace

const KernelSet& choose_kernel_set(const char* forced) {
  const std::vector<const KernelSet*> supported = supported_kernel_sets();
  if (!forced || !*forced) return *supported.front();
  for (const KernelSet* set : all_sets())
    if (set->name == std::string(forced)) {
      if (!cpu_runs(*set))
        throw Error(std::string("R3_KERNELS=") + forced + ": this CPU cannot run the " + forced +
                    " kernels (it supports " + names_of(supported) + ")");
      return *set;
    }
  throw Error(std::string("R3_KERNELS=") + forced + ": unknown kernel set (one of " +
              names_of(all_sets()) + ")");
}

std::vector<const KernelSet*> supported_kernel_sets() {
  std::vector<const KernelSet*> out;
  for (const KernelSet* set : all_sets())
    if (cpu_runs(*set)) out.push_back(set);
  return out;
}

const KernelSet& active_kernels() {
  static const KernelSet& set = choose_kernel_set(
      std::getenv("R3_KERNELS"));  // a throw leaves it unset: the next call throws again
  return set;
}

void matmul_rows(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                 int o_end) {
  active_kernels().matmul_rows(x, W, y, ldy, o_begin, o_end);
}

template <typename KvT>
void attend(const float* q, int head_dim, int pos, float scale, const PagedHead<KvT>& kv,
            float* scores, float* out) {
  if constexpr (std::is_same_v<KvT, float>)
    active_kernels().attend_f32(q, head_dim, pos, scale, kv, scores, out);
  else
    active_kernels().attend_bf16(q, head_dim, pos, scale, kv, scores, out);
}

template <typename KvT>
void attend_group(const float* const* q, const int* pos, int nq, int head_dim, float scale,
                  const PagedHead<KvT>& kv, float* scores, int score_stride, float* const* out) {
  if constexpr (std::is_same_v<KvT, float>)
    active_kernels().attend_group_f32(q, pos, nq, head_dim, scale, kv, scores, score_stride, out);
  else
    active_kernels().attend_group_bf16(q, pos, nq, head_dim, scale, kv, scores, score_stride, out);
}

template void attend(const float*, int, int, float, const PagedHead<float>&, float*, float*);
template void attend(const float*, int, int, float, const PagedHead<uint16_t>&, float*, float*);
template void attend_group(const float* const*, const int*, int, int, float,
                           const PagedHead<float>&, float*, int, float* const*);
template void attend_group(const float* const*, const int*, int, int, float,
                           const PagedHead<uint16_t>&, float*, int, float* const*);

template <typename KvT>
void attend_heads(const float* q, int h0, int h1, int group, int head_dim, int pos, float scale,
                  const PagedHead<KvT>& kv, const float* sinks, float* scores, int score_stride,
                  float* out) {
  if constexpr (std::is_same_v<KvT, float>)
    active_kernels().attend_heads_f32(q, h0, h1, group, head_dim, pos, scale, kv, sinks, scores,
                                      score_stride, out);
  else
    active_kernels().attend_heads_bf16(q, h0, h1, group, head_dim, pos, scale, kv, sinks, scores,
                                       score_stride, out);
}

template void attend_heads(const float*, int, int, int, int, int, float, const PagedHead<float>&,
                           const float*, float*, int, float*);
template void attend_heads(const float*, int, int, int, int, int, float, const PagedHead<uint16_t>&,
                           const float*, float*, int, float*);

template <typename KvT>
void attend_latent_heads(const float* q, int h0, int h1, int value_width, int pos, float scale,
                         const PagedLatent<KvT>& cache, float* scores, int score_stride, float* out,
                         size_t out_stride) {
  if constexpr (std::is_same_v<KvT, float>)
    active_kernels().attend_latent_heads_f32(q, h0, h1, value_width, pos, scale, cache, scores,
                                             score_stride, out, out_stride);
  else
    active_kernels().attend_latent_heads_bf16(q, h0, h1, value_width, pos, scale, cache, scores,
                                              score_stride, out, out_stride);
}

template void attend_latent_heads(const float*, int, int, int, int, float,
                                  const PagedLatent<float>&, float*, int, float*, size_t);
template void attend_latent_heads(const float*, int, int, int, int, float,
                                  const PagedLatent<uint16_t>&, float*, int, float*, size_t);

void rms_norm(const float* x, const TensorView& w, int64_t w_offset, int n, float eps, float* y,
              float offset) {
  active_kernels().rms_norm(x, w, w_offset, n, eps, y, offset);
}
void add_bias(float* x, const TensorView& b, int64_t b_offset, int n) {
  active_kernels().add_bias(x, b, b_offset, n);
}
void silu_mul(const float* gate, const float* up, float* out, int n) {
  active_kernels().silu_mul(gate, up, out, n);
}
void clamped_swiglu(const float* gate, const float* up, float* out, int n, float limit,
                    float alpha) {
  active_kernels().clamped_swiglu(gate, up, out, n, limit, alpha);
}
void round_to_bf16(float* x, int64_t n, uint16_t* bits) {
  active_kernels().round_to_bf16(x, n, bits);
}
void softmax(const float* x, int n, float* out) { active_kernels().softmax(x, n, out); }
double sum_f64(const float* x, int n) { return active_kernels().sum_f64(x, n); }

double measure_read_bandwidth(ThreadPool* pool, size_t bytes) {
  return active_kernels().measure_read_bandwidth(pool, bytes);
}
double measure_peak_gflops(ThreadPool* pool, std::string* instruction) {
  return active_kernels().measure_peak_gflops(pool, instruction);
}
double measure_fma_peak_gflops(ThreadPool* pool) {
  return active_kernels().measure_fma_peak_gflops(pool);
}

void take_faster_bf16_peak(MachineLimits& m) {
  if (m.fma_peak_gflops <= m.peak_gflops) return;
  char said[192];
  std::snprintf(said, sizeof said,
                "vfmadd231ps on bf16 widened to fp32 (faster here than %s: %.0f GFLOP/s)",
                m.peak_instruction.c_str(), m.peak_gflops);
  m.peak_instruction = said;
  m.peak_gflops = m.fma_peak_gflops;
}

MachineLimits measure_machine(ThreadPool* pool) {
  MachineLimits m;
  m.kernels = active_kernels().name;
  m.read_gb_per_s = measure_read_bandwidth(pool);
  m.peak_gflops = measure_peak_gflops(pool, &m.peak_instruction);
  m.fma_peak_gflops = measure_fma_peak_gflops(pool);
  take_faster_bf16_peak(m);
  return m;
}

}  // namespace r3::kernels
