// y[t, o] = sum_i W[o, i] * x[t, i] for a weight W [O, I] stored as bf16 or f32 (HF layout).
// x holds bf16 values (round_to_bf16 makes them and their bf16 bits). Every y[t, o] is one dot in
// the fixed order of dot.h, so a token's result does not depend on how many rows x has or where
// it sits. Tiles of 4 weight rows x up to 4 tokens share loads; work is split over output rows.
#pragma once
#include <cstdint>

#include "core/thread_pool.h"
#include "model/safetensors.h"

namespace r3::kernels {

struct Activations {
  const float* f32 = nullptr;      // [T, n] (values are bf16-representable)
  const uint16_t* bf16 = nullptr;  // [T, n] the same values as bf16 bits
  int rows = 0;
};

// Rows [o_begin, o_end) of W for every activation row.
void matmul_rows(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin, int o_end);
// All rows, split across the pool.
void matmul(const Activations& x, const TensorView& W, float* y, ThreadPool* pool);
// In place: each value replaced by the nearest bf16 value; its bits go to bits (may be null).
void round_to_bf16(float* x, int64_t n, uint16_t* bits);

}  // namespace r3::kernels
