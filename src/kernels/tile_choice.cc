#include "kernels/tile_choice.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/kernel_set.h"
#include "kernels/machine_cache.h"
#include "kernels/matmul.h"

namespace r3::kernels {

namespace {
std::atomic<Bf16Tiles> g_tiles{Bf16Tiles::Fma};

// GFLOP/s of one thread on a 64-token matmul whose weights stay in L2 (compute-bound, as
// prefill is): the best of a few runs.
double time_tiles(Bf16Tiles t) {
  constexpr int kT = 64, kO = 256, kI = 1024;
  static const auto data = [] {
    std::mt19937 rng(5);
    std::normal_distribution<float> n;
    std::vector<uint16_t> w(size_t(kO) * kI);
    for (auto& v : w) v = f32_to_bf16(n(rng));
    return w;
  }();
  TensorView W;
  W.name = "tile timing";
  W.dtype = DType::BF16;
  W.shape = {kO, kI};
  W.data = data.data();
  const PackedBf16 packed = pack_bf16(W);
  W.packed = packed.data();
  std::vector<float> x(size_t(kT) * kI, 0.25f), y(size_t(kT) * kO);
  std::vector<uint16_t> xb(x.size());
  round_to_bf16(x.data(), int64_t(x.size()), xb.data());
  const Bf16Tiles before = bf16_tiles();
  set_bf16_tiles(t);
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    matmul_rows({x.data(), xb.data(), kT}, W, y.data(), kO, 0, kO);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  set_bf16_tiles(before);
  return 2.0 * kT * kO * kI / best / 1e9;
}
}  // namespace

const char* bf16_tiles_name(Bf16Tiles t) { return t == Bf16Tiles::DotProduct ? "dp" : "fma"; }
Bf16Tiles bf16_tiles() { return g_tiles.load(std::memory_order_relaxed); }
void set_bf16_tiles(Bf16Tiles t) { g_tiles.store(t, std::memory_order_relaxed); }

TileChoice choose_bf16_tiles(const std::string& cache_file, const char* forced) {
  TileChoice c;
  if (!(forced && *forced) && std::string(active_kernels().name) != "avx512bf16") {
    c.source = "no AVX512-BF16 kernels";
  } else {
    const MachineChoice m = choose_on_machine(cache_file, "R3_TILES", forced, {"fma", "dp"}, [&] {
      c.fma_gflops = time_tiles(Bf16Tiles::Fma);
      c.dp_gflops = time_tiles(Bf16Tiles::DotProduct);
      return c.dp_gflops > c.fma_gflops ? "dp" : "fma";
    });
    c.tiles = m.name == "dp" ? Bf16Tiles::DotProduct : Bf16Tiles::Fma;
    c.source = m.source;
  }
  set_bf16_tiles(c.tiles);
  return c;
}

const TileChoice& tuned_bf16_tiles() {
  static const TileChoice choice =
      choose_bf16_tiles(machine_cache_file("tiles"), std::getenv("R3_TILES"));
  return choice;
}

}  // namespace r3::kernels
