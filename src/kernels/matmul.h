// y[t, o] = sum_i W[o, i] * x[t, i] for a weight W [O, I] stored as bf16 or f32 (HF layout).
// x must already be rounded to bf16 values (round_rows_bf16) where the numerics ask for it.
// Every y[t, o] is one dot() in the fixed order of dot.h: a token's result does not depend on
// how many rows are in x or where it sits. Work is split over output features only.
#pragma once
#include "core/thread_pool.h"
#include "model/safetensors.h"

namespace r3::kernels {

// Rows [o_begin, o_end) of W for tokens [0, T).
void matmul_rows(const float* x, int T, const TensorView& W, float* y, int ldy, int o_begin,
                 int o_end);
// All rows, split across the pool.
void matmul(const float* x, int T, const TensorView& W, float* y, ThreadPool* pool);
// In place: each value replaced by the nearest bf16 value.
void round_rows_bf16(float* x, int64_t n);

}  // namespace r3::kernels
