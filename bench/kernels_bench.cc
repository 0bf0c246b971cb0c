// Google Benchmark microbenchmarks of the engine kernels. Bytes/s counters are weight bytes
// streamed; compare with `r3 bench`'s measured streaming-read bandwidth.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/matmul.h"

namespace {

struct Weights {
  std::vector<uint16_t> bf16;
  r3::kernels::PackedBf16 packed;
  r3::TensorView view;
  Weights(int rows, int cols) : bf16(size_t(rows) * size_t(cols)) {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0, 0.05f);
    for (auto& v : bf16) v = r3::f32_to_bf16(d(rng));
    view.dtype = r3::DType::BF16;
    view.shape = {rows, cols};
    view.data = bf16.data();
    packed = r3::kernels::pack_bf16(view);
    view.packed = packed.data();
  }
};

r3::ThreadPool& pool() {
  static r3::ThreadPool p(2);
  return p;
}

// Many distinct matrices so the weights stream from memory, as in decode.
void BM_MatmulBf16(benchmark::State& state) {
  const int T = int(state.range(0)), rows = int(state.range(1)), cols = int(state.range(2));
  const int copies = int(std::max<int64_t>(1, (int64_t(512) << 20) / (int64_t(rows) * cols * 2)));
  std::vector<Weights> ws;
  for (int i = 0; i < copies; ++i) ws.emplace_back(rows, cols);
  std::vector<float> x(size_t(T) * cols, 0.5f), y(size_t(T) * rows);
  std::vector<uint16_t> xb(x.size());
  r3::kernels::round_to_bf16(x.data(), int64_t(x.size()), xb.data());
  int i = 0;
  for (auto _ : state) {
    r3::kernels::matmul({x.data(), xb.data(), T}, ws[size_t(i)].view, y.data(), &pool());
    i = (i + 1) % copies;
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * rows * cols * 2);
  state.counters["GFLOP/s"] = benchmark::Counter(double(state.iterations()) * 2.0 * T * rows * cols / 1e9,
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_MatmulBf16)
    ->Args({1, 1024, 1024})
    ->Args({1, 512, 1024})
    ->Args({1, 1024, 512})
    ->Args({4, 512, 1024})
    ->Args({6, 512, 1024})
    ->Args({32, 512, 1024})
    ->Args({32, 1024, 1024})
    ->Args({32, 32000, 1024})
    ->Args({256, 1024, 1024})
    ->UseRealTime();

}  // namespace
