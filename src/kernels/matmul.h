// y[t, o] = sum_i W[o, i] * x[t, i] for a weight W [O, I] stored as bf16 or f32 (HF layout).
// x holds bf16 values (round_to_bf16 makes them and their bf16 bits). Every y[t, o] is one dot in
// the fixed order of dot.h, so a token's result does not depend on how many rows x has or where
// it sits. bf16 weights are first repacked (pack_bf16) into panels of 16 rows whose input pairs
// are interleaved, so one vector load feeds 16 output rows and no horizontal sums are needed;
// f32 weights use tiles of 4 rows x up to 4 tokens. Work is split over output rows.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/big_alloc.h"
#include "core/panel_layout.h"
#include "core/tensor_view.h"
#include "core/thread_pool.h"

namespace r3::kernels {

// Storage aligned to a cache line: each 64-byte pair row of a packed panel is then one line
// (malloc's 16-byte alignment made every weight load a split load); big arrays also get huge
// pages (core/big_alloc.h).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(big_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { big_free(p, n * sizeof(T)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
};

struct Activations {
  const float* f32 = nullptr;      // [T, n] (values are bf16-representable)
  const uint16_t* bf16 = nullptr;  // [T, n] the same values as bf16 bits
  int rows = 0;
  // Row r of this input is row row_ids[r] of f32/bf16 (null: row r), so an expert reads its
  // tokens where they are instead of from a gathered copy.
  const int* row_ids = nullptr;
  int row(int r) const { return row_ids ? row_ids[r] : r; }
};

// The panel layouts (kPanelRows, MXFP4 groups, native FP8 lines) are core/panel_layout.h's.
using r3::fp8_code_byte;
using r3::fp8_native;
using r3::fp8_panel_bytes;
using r3::fp8_scales_offset;
using r3::kMxfp4GroupBytes;
using r3::kMxfp4GroupPairs;
using r3::kPanelRows;
using r3::mxfp4_code_byte;
using r3::mxfp4_code_shift;
using r3::mxfp4_panel_bytes;
using r3::packable;
using r3::packed_panel_bytes;

// The engine layout of a bf16 weight [O, I] (I even): panels of 16 rows (zero-padded), each
// [I/2 pairs][16 rows][2]. Point TensorView::packed at the result.
using PackedBf16 = std::vector<uint16_t, CacheLineAllocator<uint16_t>>;
PackedBf16 pack_bf16(const TensorView& W);
// Elements of W's packed form (panels x pairs x 16 x 2).
size_t packed_bf16_size(const TensorView& W);
// Panels [panel_begin, panel_end) of W into `packed` (packed_bf16_size elements), in place: a
// refit rewrites the engine's panels without allocating. Every byte of those panels is written,
// the last panel's rows past W's last as zeros, so `packed` needs no clearing first.
void pack_bf16_panels(const TensorView& W, uint16_t* packed, int64_t panel_begin,
                      int64_t panel_end);

// Rows [o_begin, o_end) of W for every activation row (bf16 W must be packed).
void matmul_rows(const Activations& x, const TensorView& W, float* y, int ldy, int o_begin,
                 int o_end);
// Puts the first lines of a range's first pass of panels (what matmul_rows reads first) in
// flight towards L2: a caller that knows its next range issues this before the current one, so
// the next starts on L2 hits instead of memory misses. Weights that are not packed: nothing.
void prefetch_rows_start(const TensorView& W, int o_begin, int o_end);
// All rows, split across the pool.
void matmul(const Activations& x, const TensorView& W, float* y, ThreadPool* pool);
// Several weights applied to the same input (y_i = x W_i^T, ld = W_i's rows) as one job on the
// pool: no barrier between them (e.g. q, k and v).
struct MatmulOut {
  const TensorView* w;
  float* y;
};
void matmul_many(const Activations& x, std::span<const MatmulOut> outs, ThreadPool* pool);
// In place: each value replaced by the nearest bf16 value; its bits go to bits (may be null).
void round_to_bf16(float* x, int64_t n, uint16_t* bits);

}  // namespace r3::kernels
