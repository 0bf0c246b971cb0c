// Which of two same-bits bf16 tiles the matmul runs for 2 or more tokens on a CPU with
// AVX512-BF16: vfmadd on widened weights (twice the instructions per weight) or vdpbf16ps. Both
// compute the per-row order of dot.h, so the bits are the same; which is faster depends on the
// rate at which the CPU issues vdpbf16ps (half the fma rate on Sapphire Rapids, full on Zen 4),
// so it is timed on the machine, once per CPU model, and cached. Single tokens always use
// vdpbf16ps (pure weight streaming, one instruction per weight line).
#pragma once
#include <string>

#include "core/thread_pool.h"

namespace r3::kernels {

enum class Bf16Tiles { Fma, DotProduct };
const char* bf16_tiles_name(Bf16Tiles t);  // "fma" or "dp"

// The tiles the matmul runs now (Fma until a choice is made).
Bf16Tiles bf16_tiles();
void set_bf16_tiles(Bf16Tiles t);

struct TileChoice {
  Bf16Tiles tiles = Bf16Tiles::Fma;
  // How it was chosen: "R3_TILES", "cached for <cpu>", "timed on <cpu>", or why there was no
  // choice ("no AVX512-BF16 kernels").
  std::string source;
  double fma_gflops = 0, dp_gflops = 0;  // when timed
};

// The choice for this process: R3_TILES=fma|dp if set (an unknown value is an r3::Error), else
// the entry for this CPU model in cache_file, else both tiles timed on a compute-bound matmul
// (a few milliseconds) and the winner written to cache_file (unwritable: not cached). Applies
// the choice (set_bf16_tiles) and returns it.
TileChoice choose_bf16_tiles(const std::string& cache_file, const char* forced);
// The same, once per process, with the cache at $XDG_CACHE_HOME/r3/tiles.json (or
// ~/.cache/r3/tiles.json) and R3_TILES from the environment.
const TileChoice& tuned_bf16_tiles();

}  // namespace r3::kernels
