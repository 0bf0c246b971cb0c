// The machine measurements of machine_limits.h, compiled once per instruction set (isa.h): each
// measures with its own widest instructions.
#include "kernels/machine_limits.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/big_alloc.h"
#include "kernels/isa_entry_points.h"

// Compiled for this file's instruction set from here on (isa.h).
// clang-format off
#include "kernels/isa_begin.h"
#include "kernels/vec16.h"
// clang-format on

namespace r3::kernels {
inline namespace R3_ISA_NS {

namespace {

#if R3_ISA_AVX512
constexpr bool defined_avx512 = true;
#else
constexpr bool defined_avx512 = false;
#endif
#if R3_ISA_AVX2
constexpr bool defined_avx2 = true;
#else
constexpr bool defined_avx2 = false;
#endif

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Each thread reads its share as 8 interleaved sequential streams with software prefetch, the
// access pattern that reads fastest here (one plain stream per thread reaches only ~3/4 of it).
double measure_read_bandwidth(ThreadPool* pool, size_t bytes) {
  constexpr int kStreams = 8;
  [[maybe_unused]] constexpr size_t kPrefetchFloats = 32 * 16;  // 32 cache lines ahead per stream
  const size_t n = bytes / sizeof(float);
  // On the kind of pages the engine's weights and KV cache stream from (core/big_alloc.h), so
  // the fractions against this read compare like with like.
  BigArray<float> buf(n);
  pool->parallel_for(int64_t(n / 4096), [&](int64_t b, int64_t e) {
    std::memset(buf.get() + b * 4096, 1, size_t(e - b) * 4096 * sizeof(float));
  });
  const int parts = pool->size();
  const size_t per_stream = n / size_t(parts) / kStreams / 16 * 16;
  double best = 0;
  std::vector<float> sinks(size_t(parts) * 16);
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    pool->parallel_for(parts, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) {
        const float* x = buf.get() + size_t(p) * (n / size_t(parts));
#if defined(R3_VEC16)  // AVX-512, or AVX2 as two halves (vec16.h)
        Vec16 acc[kStreams];
        for (auto& a : acc) a = Vec16::zero();
        for (size_t i = 0; i < per_stream; i += 16)
#pragma GCC unroll 8
          for (int s = 0; s < kStreams; ++s) {
            const float* at = x + size_t(s) * per_stream + i;
            acc[s] = acc[s] + Vec16::load(at);
            _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchFloats), _MM_HINT_T0);
          }
        for (int s = 1; s < kStreams; ++s) acc[0] = acc[0] + acc[s];
        float lanes[16];
        acc[0].store(lanes);
        sinks[size_t(p) * 16] = lanes[0];
#else
        float acc[kStreams] = {0};
        for (size_t i = 0; i < per_stream; ++i)
          for (int s = 0; s < kStreams; ++s) acc[s] += x[size_t(s) * per_stream + i];
        float total = 0.f;  // every stream feeds the sink, so no stream's loads are dead code
        for (float a : acc) total += a;
        sinks[size_t(p) * 16] = total;
#endif
      }
    });
    const double s = seconds_since(t0);
    best = std::max(best, double(per_stream * kStreams * size_t(parts) * sizeof(float)) / s / 1e9);
  }
  return best;
}

#if R3_ISA_AVX2
// GFLOP/s of kChains independent chains of `step` on every thread, `flops` per instruction.
// The chains start equal and see the same operations, so without keep_chain the compiler
// merges them into one dependent chain and the loop measures latency, not throughput. The
// empty asm makes each register opaque; it emits no instruction.
template <typename V, typename Step>
double chains_gflops(ThreadPool* pool, double flops, Step step) {
  constexpr int kChains = 12;
  constexpr int64_t kIters = 20'000'000;
  std::vector<float> sinks(size_t(pool->size()) * 16);
  auto t0 = std::chrono::steady_clock::now();
  pool->parallel_for(pool->size(), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      V acc[kChains] = {};
      for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 16
        for (auto& a : acc) a = step(a);
#pragma GCC unroll 16
        for (auto& a : acc) asm volatile("" : "+x"(a));
      }
      float lanes[16];
      std::memcpy(lanes, &acc[kChains - 1], sizeof(V));
      sinks[size_t(p) * 16] = lanes[0];
    }
  });
  return flops * kChains * double(kIters) * pool->size() / seconds_since(t0) / 1e9;
}

double fma_gflops(ThreadPool* pool) {
#if R3_ISA_AVX512
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  return chains_gflops<__m512>(pool, 32, [&](__m512 a) { return _mm512_fmadd_ps(a, x, y); });
#else
  const __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
  return chains_gflops<__m256>(pool, 16, [&](__m256 a) { return _mm256_fmadd_ps(a, x, y); });
#endif
}
#else
double fma_gflops(ThreadPool* pool) {
  constexpr int64_t kIters = 20'000'000;
  std::vector<float> sinks(size_t(pool->size()) * 16);
  auto t0 = std::chrono::steady_clock::now();
  pool->parallel_for(pool->size(), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      float acc[8] = {0};
      for (int64_t i = 0; i < kIters; ++i)
#pragma GCC unroll 8
        for (auto& a : acc) a = a * 1.0001f + 0.9999f;
      sinks[size_t(p) * 16] = acc[0] + acc[7];
    }
  });
  return 16.0 * double(kIters) * pool->size() / seconds_since(t0) / 1e9;
}
#endif

double measure_peak_gflops(ThreadPool* pool, std::string* instruction) {
#if R3_ISA_AVX512BF16
  if (instruction) *instruction = "vdpbf16ps zmm (AVX512-BF16)";
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
  // 32 bf16 pairs x (mul + add) per instruction.
  return chains_gflops<__m512>(pool, 64, [&](__m512 a) { return _mm512_dpbf16_ps(a, x, y); });
#else
  if (instruction)
    *instruction = defined_avx512 ? "vfmadd231ps zmm (no AVX512-BF16)"
                   : defined_avx2 ? "vfmadd231ps ymm (no AVX-512)"
                                  : "scalar fma";
  return fma_gflops(pool);
#endif
}

double measure_fma_peak_gflops(ThreadPool* pool) { return fma_gflops(pool); }

}  // namespace R3_ISA_NS
}  // namespace r3::kernels

#include "kernels/isa_end.h"
