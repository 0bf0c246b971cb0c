// Google Benchmark microbenchmarks of the engine kernels. Bytes/s counters are weight (or KV)
// bytes streamed; compare with `r3 bench`'s measured streaming-read bandwidth.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/tensor_view.h"
#include "core/thread_pool.h"
#include "kernels/attention.h"
#include "kernels/matmul.h"
#include "kernels/tile_choice.h"

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

// Both cores, and the bf16 tiles the engine would run on this machine (Engine's constructor makes
// the same choice; without it every matmul here would take the fma tiles).
r3::ThreadPool& pool() {
  static r3::ThreadPool p(2);
  static const bool tiles_chosen = (r3::kernels::tuned_bf16_tiles(), true);
  (void)tiles_chosen;
  return p;
}

// Many distinct matrices so the weights stream from memory, as in decode. Bytes/s counts the
// bytes the kernel really reads (MXFP4: 4.25 bits per weight).
template <typename W>
void matmul_streaming(benchmark::State& state) {
  const int T = int(state.range(0)), rows = int(state.range(1)), cols = int(state.range(2));
  std::vector<W> ws;
  ws.emplace_back(rows, cols);
  const int copies = int(std::max<int64_t>(1, (int64_t(512) << 20) / int64_t(ws[0].view.nbytes())));
  while (int(ws.size()) < copies) ws.emplace_back(rows, cols);
  std::vector<float> x(size_t(T) * cols, 0.5f), y(size_t(T) * rows);
  std::vector<uint16_t> xb(x.size());
  r3::kernels::round_to_bf16(x.data(), int64_t(x.size()), xb.data());
  int i = 0;
  for (auto _ : state) {
    r3::kernels::matmul({x.data(), xb.data(), T}, ws[size_t(i)].view, y.data(), &pool());
    i = (i + 1) % copies;
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(ws[0].view.nbytes()));
  state.counters["GFLOP/s"] = benchmark::Counter(
      double(state.iterations()) * 2.0 * T * rows * cols / 1e9, benchmark::Counter::kIsRate);
}

void BM_MatmulBf16(benchmark::State& state) { matmul_streaming<Weights>(state); }
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

// MXFP4 weights (decoded inside the matmul), the same shapes.
struct Mxfp4Weights {
  std::vector<uint8_t> blocks, scales;
  r3::kernels::PackedBf16 packed;
  r3::TensorView view;
  Mxfp4Weights(int rows, int cols)
      : blocks(size_t(rows) * cols / 2), scales(size_t(rows) * cols / 32) {
    std::mt19937 rng(1);
    for (auto& b : blocks) b = uint8_t(rng());
    for (auto& s : scales) s = uint8_t(118 + rng() % 4);
    view.dtype = r3::DType::MXFP4;
    view.shape = {rows, cols};
    view.data = blocks.data();
    view.scales = scales.data();
    packed = r3::kernels::pack_bf16(view);
    view.packed = packed.data();
  }
};

void BM_MatmulMxfp4(benchmark::State& state) { matmul_streaming<Mxfp4Weights>(state); }
BENCHMARK(BM_MatmulMxfp4)
    ->Args({1, 1024, 1024})
    ->Args({1, 512, 1024})
    ->Args({8, 512, 1024})
    ->Args({32, 512, 1024})
    ->UseRealTime();

// Block-scaled FP8 weights (128 x 128 blocks, as DeepSeek-V3 is released), the same shapes.
struct Fp8Weights {
  std::vector<uint8_t> values;
  std::vector<float> scales;
  r3::kernels::PackedBf16 packed;
  r3::TensorView view;
  Fp8Weights(int rows, int cols)
      : values(size_t(rows) * cols), scales(size_t((rows + 127) / 128) * ((cols + 127) / 128)) {
    std::mt19937 rng(1);
    for (auto& b : values) do
        b = uint8_t(rng());
      while (r3::e4m3_is_nan(b));
    for (auto& s : scales) s = std::ldexp(1.f + float(rng() % 100) / 100.f, -12);
    view.dtype = r3::DType::F8_E4M3;
    view.shape = {rows, cols};
    view.data = values.data();
    view.scale_inv = scales.data();
    view.block_rows = view.block_cols = 128;
    packed = r3::kernels::pack_bf16(view);
    view.packed = packed.data();
  }
};

void BM_MatmulFp8(benchmark::State& state) { matmul_streaming<Fp8Weights>(state); }
BENCHMARK(BM_MatmulFp8)
    ->Args({1, 1024, 1024})
    ->Args({1, 512, 1024})
    ->Args({32, 512, 1024})
    ->UseRealTime();

// Repacking one weight into its panels on one core, as a refit does for every changed tensor
// (the model runner spreads items of panels over the threads). Bytes/s counts the stored bytes
// read; compare with `r3 bench`'s weight_sync entry and the measured streaming read.
template <typename W>
void pack_panels(benchmark::State& state) {
  W w(int(state.range(0)), int(state.range(1)));
  const int64_t panels = (w.view.shape[0] + r3::kernels::kPanelRows - 1) / r3::kernels::kPanelRows;
  for (auto _ : state) {
    r3::kernels::pack_bf16_panels(w.view, w.packed.data(), 0, panels);
    benchmark::DoNotOptimize(w.packed.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(w.view.nbytes()));
}
void BM_PackBf16(benchmark::State& state) { pack_panels<Weights>(state); }
void BM_PackMxfp4(benchmark::State& state) { pack_panels<Mxfp4Weights>(state); }
void BM_PackFp8(benchmark::State& state) { pack_panels<Fp8Weights>(state); }
BENCHMARK(BM_PackBf16)->Args({2880, 2880})->UseRealTime();
BENCHMARK(BM_PackMxfp4)->Args({2880, 2880})->UseRealTime();
BENCHMARK(BM_PackFp8)->Args({2048, 2048})->UseRealTime();

// The check a refit makes of every float tensor it is sent (a NaN or infinity is refused,
// core/tensor_view.h first_non_finite), on one core over the same bytes as BM_PackBf16: its cost
// beside the pack the refit does anyway. Many copies, so the bytes stream from memory.
void BM_NonFiniteScan(benchmark::State& state) {
  const int rows = int(state.range(0)), cols = int(state.range(1));
  std::vector<Weights> ws;
  ws.emplace_back(rows, cols);
  const int copies = int(std::max<int64_t>(1, (int64_t(512) << 20) / int64_t(ws[0].view.nbytes())));
  while (int(ws.size()) < copies) ws.emplace_back(rows, cols);
  int i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(r3::first_non_finite(ws[size_t(i)].view));
    i = (i + 1) % copies;
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(ws[0].view.nbytes()));
}
BENCHMARK(BM_NonFiniteScan)->Args({2880, 2880})->UseRealTime();

// One MoE layer of the bench preset as the engine runs it in batch-32 decode: 64 experts
// (gate/up 512x1024, down 1024x512), each with its own tokens, items of 256 rows on both cores
// (each core starting its next item's weights on their way before it runs the current one),
// gate/up then down. Arg: tokens per expert, or 0 for the batch-32 top-8 draw (binomial 32, 1/8).
// 8 layers of distinct weights (1.5 GB in bf16) so they stream from memory. W: the experts'
// weight format (bytes/s counts the bytes the kernels really read).
template <typename W>
struct MoeExpert {
  static constexpr int kH = 1024, kI = 512;
  W gate{kI, kH}, up{kI, kH}, down{kH, kI};
};

template <typename W>
void moe_layer(benchmark::State& state) {
  using Expert = MoeExpert<W>;
  constexpr int kE = 64, kH = Expert::kH, kI = Expert::kI, kLayers = 8;
  constexpr int kItem = 256;  // rows per item, as the model runner
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
    auto run = [&](int rows, auto fn, auto ahead) {
      items.clear();
      for (int e = 0; e < kE; ++e)
        if (n_of[size_t(e)] > 0)
          for (int r = 0; r < rows; r += kItem) items.push_back({e, r, r + kItem});
      pool().parallel_for_each(
          int64_t(items.size()), [&](int64_t i) { fn(items[size_t(i)]); },
          [&](int64_t i) { ahead(items[size_t(i)]); });
    };
    run(
        kI,
        [&](const Item& it) {
          const Expert& w = *experts[size_t(layer * kE + it.e)];
          const r3::kernels::Activations a{x.data(), xb.data(), n_of[size_t(it.e)]};
          float* g = gate.data() + size_t(it.e) * 32 * kI;
          r3::kernels::matmul_rows(a, w.gate.view, g, kI, it.begin, it.end);
          r3::kernels::matmul_rows(a, w.up.view, up.data() + size_t(it.e) * 32 * kI, kI, it.begin,
                                   it.end);
        },
        [&](const Item& it) {
          const Expert& w = *experts[size_t(layer * kE + it.e)];
          r3::kernels::prefetch_rows_start(w.gate.view, it.begin, it.end);
          r3::kernels::prefetch_rows_start(w.up.view, it.begin, it.end);
        });
    run(
        kH,
        [&](const Item& it) {
          const Expert& w = *experts[size_t(layer * kE + it.e)];
          const r3::kernels::Activations a{h.data(), hb.data(), n_of[size_t(it.e)]};
          r3::kernels::matmul_rows(a, w.down.view, out.data(), kH, it.begin, it.end);
        },
        [&](const Item& it) {
          r3::kernels::prefetch_rows_start(experts[size_t(layer * kE + it.e)]->down.view, it.begin,
                                           it.end);
        });
    const Expert& any = *experts[0];
    const int64_t expert_bytes =
        int64_t(any.gate.view.nbytes() + any.up.view.nbytes() + any.down.view.nbytes());
    for (int e = 0; e < kE; ++e) bytes += n_of[size_t(e)] > 0 ? expert_bytes : 0;
    layer = (layer + 1) % kLayers;
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(bytes);
}
void BM_MoeLayer(benchmark::State& state) { moe_layer<Weights>(state); }
BENCHMARK(BM_MoeLayer)->Arg(0)->Arg(1)->Arg(3)->Arg(4)->Arg(5)->Arg(8)->UseRealTime();
// The same layer with MXFP4 experts (GPT-OSS as released; 0.4 GB for the 8 layers); 16 and 32
// tokens an expert are either side of where the fused decode tiles hand over to decoded panels.
void BM_MoeLayerMxfp4(benchmark::State& state) { moe_layer<Mxfp4Weights>(state); }
BENCHMARK(BM_MoeLayerMxfp4)
    ->Arg(0)
    ->Arg(1)
    ->Arg(3)
    ->Arg(4)
    ->Arg(5)
    ->Arg(8)
    ->Arg(16)
    ->Arg(32)
    ->UseRealTime();
// And with block-scaled FP8 experts (DeepSeek-V3 as released; 128 x 128 blocks).
void BM_MoeLayerFp8(benchmark::State& state) { moe_layer<Fp8Weights>(state); }
BENCHMARK(BM_MoeLayerFp8)
    ->Arg(0)
    ->Arg(1)
    ->Arg(3)
    ->Arg(4)
    ->Arg(5)
    ->Arg(8)
    ->Arg(16)
    ->Arg(32)
    ->UseRealTime();

// Decode attention of one layer as the engine runs it: `seqs` sequences of `ctx` keys, 16 kv
// heads of 64, on both cores; enough layers of distinct caches (>= 512 MB) that the KV streams
// from memory, as it does when a step's weights have evicted it. Args: context length, KV block
// size, heads per item, sequences, block order. Heads per item 0: an item is a sequence, one head
// at a time (attend_group of one query); h > 0: items of h heads each (attend_heads), so batch 1
// with h = 4 is the engine's split of one sequence's heads over the cores. Block order 1: a
// sequence's blocks scattered over the pool (as after churn); 0: in allocation order, adjacent
// (as a prompt's blocks mostly are: the free list hands them out in order).
template <typename KvT>
void attention_decode(benchmark::State& state) {
  constexpr int kHeads = 16, kHd = 64, kKvDim = kHeads * kHd;
  const int ctx = int(state.range(0)), kBs = int(state.range(1)),
            blocks_per_seq = (ctx + kBs - 1) / kBs;
  const int per_item = int(state.range(2)), seqs = int(state.range(3));
  const bool scattered = state.range(4) != 0;
  const int parts = per_item > 0 ? kHeads / per_item : 1;
  const size_t layer_elems = size_t(seqs) * blocks_per_seq * kBs * kKvDim;
  const int layers =
      int(std::max<size_t>(1, (size_t(512) << 20) / (layer_elems * 2 * sizeof(KvT))));
  std::vector<KvT, r3::kernels::CacheLineAllocator<KvT>> k(layer_elems * layers),
      v(k.size());  // as the engine
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0, 1);
  for (size_t i = 0; i < k.size(); ++i) {  // normal values (denormals would time microcode assists)
    const float x = nd(rng);
    if constexpr (std::is_same_v<KvT, float>)
      k[i] = v[i] = x;
    else
      k[i] = v[i] = r3::f32_to_bf16(x);
  }
  std::vector<int> table(size_t(seqs) * blocks_per_seq);
  for (size_t i = 0; i < table.size(); ++i) table[i] = int(i);
  if (scattered) std::shuffle(table.begin(), table.end(), rng);
  std::vector<float> q(size_t(seqs) * kKvDim, 0.1f), out(q.size());
  int layer = 0;
  for (auto _ : state) {
    const KvT* kl = k.data() + size_t(layer) * layer_elems;
    const KvT* vl = v.data() + size_t(layer) * layer_elems;
    pool().parallel_for_each(int64_t(seqs) * parts, [&](int64_t item) {
      const int seq = int(item / parts), part = int(item % parts);
      const int* seq_table = table.data() + size_t(seq) * blocks_per_seq;
      thread_local std::vector<float> scores;
      scores.resize(size_t(kHeads) * (ctx + kBs));
      const int pos = ctx - 1;
      if (per_item > 0) {
        const r3::kernels::PagedHead<KvT> layer_kv{kl, vl, seq_table, kBs, kKvDim, 0};
        r3::kernels::attend_heads(q.data() + size_t(seq) * kKvDim, part * per_item,
                                  (part + 1) * per_item, 1, kHd, pos, 0.125f, layer_kv, nullptr,
                                  scores.data(), ctx + kBs, out.data() + size_t(seq) * kKvDim);
        return;
      }
      for (int head = 0; head < kHeads; ++head) {
        const r3::kernels::PagedHead<KvT> ph{kl, vl, seq_table, kBs, kKvDim, int64_t(head) * kHd};
        const float* qs[1] = {q.data() + size_t(seq) * kKvDim + size_t(head) * kHd};
        float* os[1] = {out.data() + size_t(seq) * kKvDim + size_t(head) * kHd};
        r3::kernels::attend_group(qs, &pos, 1, kHd, 0.125f, ph, scores.data(), ctx + kBs, os);
      }
    });
    layer = (layer + 1) % layers;
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * seqs * ctx * kKvDim * 2 *
                          int64_t(sizeof(KvT)));
}
void BM_AttentionDecodeF32(benchmark::State& state) { attention_decode<float>(state); }
void BM_AttentionDecodeBf16(benchmark::State& state) { attention_decode<uint16_t>(state); }
BENCHMARK(BM_AttentionDecodeF32)
    ->ArgsProduct({{32, 512, 4096}, {16}, {0, 16}, {32}, {1}})
    ->UseRealTime();
BENCHMARK(BM_AttentionDecodeBf16)
    ->ArgsProduct({{32, 512, 4096}, {16}, {0, 16}, {32}, {1}})
    ->ArgsProduct({{4096}, {16}, {0, 16}, {32}, {0}})
    ->ArgsProduct({{4096}, {32, 64}, {0, 16}, {32}, {1}})
    ->ArgsProduct({{32768}, {16}, {4, 16}, {1}, {0}})
    ->ArgsProduct(
        {{32768}, {16}, {0, 16, 4}, {1}, {1}})  // batch 1, long: one core, or the heads split
    ->UseRealTime();

}  // namespace
