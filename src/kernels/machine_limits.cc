#include "kernels/machine_limits.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace r3::kernels {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double measure_read_bandwidth(ThreadPool* pool, size_t bytes) {
  const size_t n = bytes / sizeof(float);
  std::unique_ptr<float[]> buf(new float[n]);
  pool->parallel_for(int64_t(n / 4096), [&](int64_t b, int64_t e) {
    std::memset(buf.get() + b * 4096, 1, size_t(e - b) * 4096 * sizeof(float));
  });
  double best = 0;
  std::vector<float> sinks(size_t(pool->size()) * 16);
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    const int parts = pool->size();
    pool->parallel_for(parts, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) {
        const float* x = buf.get() + size_t(p) * (n / size_t(parts));
        const size_t m = n / size_t(parts);
#if defined(__AVX512F__)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i + 64 <= m; i += 64) {
          a0 = _mm512_add_ps(a0, _mm512_loadu_ps(x + i));
          a1 = _mm512_add_ps(a1, _mm512_loadu_ps(x + i + 16));
          a2 = _mm512_add_ps(a2, _mm512_loadu_ps(x + i + 32));
          a3 = _mm512_add_ps(a3, _mm512_loadu_ps(x + i + 48));
        }
        sinks[size_t(p) * 16] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
        float s = 0;
        for (size_t i = 0; i < m; ++i) s += x[i];
        sinks[size_t(p) * 16] = s;
#endif
      }
    });
    const double s = seconds_since(t0);
    best = std::max(best, double(n / size_t(parts) * size_t(parts) * sizeof(float)) / s / 1e9);
  }
  return best;
}

#if defined(__AVX512F__)
// Chains start equal and see the same operations, so without this the compiler merges them
// into one dependent chain and the loop measures latency, not throughput. The empty asm
// makes each register opaque; it emits no instruction.
constexpr int kChains = 12;
inline void keep_chain(__m512& a) { asm volatile("" : "+v"(a)); }
#endif

double measure_peak_gflops(ThreadPool* pool, std::string* instruction) {
  const int64_t iters = 20'000'000;
  double flops_per_iter = 0;
  std::vector<float> sinks(size_t(pool->size()) * 16);
#if defined(__AVX512BF16__)
  if (instruction) *instruction = "vdpbf16ps zmm (AVX512-BF16)";
  flops_per_iter = kChains * 64;  // independent instructions x 32 bf16 pairs x (mul + add)
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      __m512 acc[kChains];
      for (auto& a : acc) a = _mm512_setzero_ps();
      const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
      for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
        for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, y);
#pragma GCC unroll 16
        for (auto& a : acc) keep_chain(a);
      }
      __m512 s = acc[0];
      for (int j = 1; j < kChains; ++j) s = _mm512_add_ps(s, acc[j]);
      sinks[size_t(p) * 16] = _mm512_reduce_add_ps(s);
    }
  };
#elif defined(__AVX512F__)
  if (instruction) *instruction = "vfmadd231ps zmm (no AVX512-BF16)";
  flops_per_iter = kChains * 32;
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      __m512 acc[kChains];
      for (auto& a : acc) a = _mm512_setzero_ps();
      const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
      for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
        for (auto& a : acc) a = _mm512_fmadd_ps(a, x, y);
#pragma GCC unroll 16
        for (auto& a : acc) keep_chain(a);
      }
      __m512 s = acc[0];
      for (int j = 1; j < kChains; ++j) s = _mm512_add_ps(s, acc[j]);
      sinks[size_t(p) * 16] = _mm512_reduce_add_ps(s);
    }
  };
#else
  if (instruction) *instruction = "scalar fma";
  flops_per_iter = 8 * 2;
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      float acc[8] = {0};
      for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 8
        for (auto& a : acc) a = a * 1.0001f + 0.9999f;
      sinks[size_t(p) * 16] = acc[0] + acc[7];
    }
  };
#endif
  auto t0 = std::chrono::steady_clock::now();
  pool->parallel_for(pool->size(), body);
  const double s = seconds_since(t0);
  return flops_per_iter * double(iters) * pool->size() / s / 1e9;
}

MachineLimits measure_machine(ThreadPool* pool) {
  MachineLimits m;
  m.read_gb_per_s = measure_read_bandwidth(pool);
  m.peak_gflops = measure_peak_gflops(pool, &m.peak_instruction);
  return m;
}

}  // namespace r3::kernels
