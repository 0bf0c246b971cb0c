// Google Benchmark microbenchmarks of the engine kernels. Bytes/s counters are weight bytes
// streamed; compare with `r3 bench`'s measured streaming-read bandwidth.
#include <benchmark/benchmark.h>

#include <memory>
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

// One MoE layer of the bench preset as the engine runs it in batch-32 decode: 64 experts
// (gate/up 512x1024, down 1024x512), each with its own tokens, items of 256 rows on both cores,
// gate/up then down. Arg: tokens per expert, or 0 for the batch-32 top-8 draw (binomial 32, 1/8).
// 8 layers of distinct weights (1.5 GB) so they stream from memory.
void BM_MoeLayer(benchmark::State& state) {
  constexpr int kE = 64, kH = 1024, kI = 512, kLayers = 8;
  constexpr int kItem = 256;  // rows per item, as the model runner
  struct Expert {
    Weights gate{kI, kH}, up{kI, kH}, down{kH, kI};
  };
  static std::vector<std::unique_ptr<Expert>> experts;
  if (experts.empty())
    for (int i = 0; i < kE * kLayers; ++i) experts.push_back(std::make_unique<Expert>());
  const int fixed = int(state.range(0));
  std::mt19937 rng(7);
  std::binomial_distribution<int> draw(32, 1.0 / 8);
  std::vector<std::vector<int>> counts(kLayers, std::vector<int>(kE));
  for (auto& layer : counts)
    for (int& n : layer) n = fixed > 0 ? fixed : draw(rng);
  std::vector<float> x(size_t(32) * kH, 0.5f), h(size_t(32) * kI), out(size_t(32) * kH);
  std::vector<uint16_t> xb(x.size()), hb(h.size());
  r3::kernels::round_to_bf16(x.data(), int64_t(x.size()), xb.data());
  for (auto& v : h) v = 0.25f;
  r3::kernels::round_to_bf16(h.data(), int64_t(h.size()), hb.data());
  std::vector<float> gate(size_t(kE) * 32 * kI), up(gate.size());
  struct Item {
    int e, begin, end;
  };
  std::vector<Item> items;
  int layer = 0;
  int64_t bytes = 0;
  for (auto _ : state) {
    const auto& n_of = counts[size_t(layer)];
    auto run = [&](int rows, auto fn) {
      items.clear();
      for (int e = 0; e < kE; ++e)
        if (n_of[size_t(e)] > 0)
          for (int r = 0; r < rows; r += kItem) items.push_back({e, r, r + kItem});
      pool().parallel_for_each(int64_t(items.size()), [&](int64_t i) { fn(items[size_t(i)]); });
    };
    run(kI, [&](const Item& it) {
      const Expert& w = *experts[size_t(layer * kE + it.e)];
      const r3::kernels::Activations a{x.data(), xb.data(), n_of[size_t(it.e)]};
      float* g = gate.data() + size_t(it.e) * 32 * kI;
      r3::kernels::matmul_rows(a, w.gate.view, g, kI, it.begin, it.end);
      r3::kernels::matmul_rows(a, w.up.view, up.data() + size_t(it.e) * 32 * kI, kI, it.begin, it.end);
    });
    run(kH, [&](const Item& it) {
      const Expert& w = *experts[size_t(layer * kE + it.e)];
      const r3::kernels::Activations a{h.data(), hb.data(), n_of[size_t(it.e)]};
      r3::kernels::matmul_rows(a, w.down.view, out.data(), kH, it.begin, it.end);
    });
    for (int e = 0; e < kE; ++e) bytes += n_of[size_t(e)] > 0 ? int64_t(3) * kI * kH * 2 : 0;
    layer = (layer + 1) % kLayers;
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(bytes);
}
BENCHMARK(BM_MoeLayer)->Arg(0)->Arg(1)->Arg(3)->Arg(4)->Arg(5)->Arg(8)->UseRealTime();

}  // namespace
