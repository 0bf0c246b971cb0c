// The matmul entry points that do not depend on the instruction set: splitting the rows over the
// pool, packing bf16 weights, rounding activations. The tiles are in matmul_tiles.cc.
#include "kernels/matmul.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/kernel_set.h"

namespace r3::kernels {

void matmul(const Activations& x, const TensorView& W, float* y, ThreadPool* pool) {
  const MatmulOut one{&W, y};
  matmul_many(x, {&one, 1}, pool);
}

void matmul_many(const Activations& x, std::span<const MatmulOut> outs, ThreadPool* pool) {
  // Blocks of whole panels (4 x 16 rows) keep writes of different threads off the same cache
  // line and let the kernel take its widest tile; the blocks of every weight form one job.
  constexpr int kRows = 64;
  int64_t work = 0;
  int blocks = 0;
  for (const MatmulOut& m : outs) {
    work += m.w->shape[0] * x.rows * m.w->shape[1];
    blocks += int((m.w->shape[0] + kRows - 1) / kRows);
  }
  if (!pool || work < (1 << 16)) {
    for (const MatmulOut& m : outs) matmul_rows(x, *m.w, m.y, int(m.w->shape[0]), 0, int(m.w->shape[0]));
    return;
  }
  pool->parallel_for_each(blocks, [&](int64_t b) {
    for (const MatmulOut& m : outs) {
      const int O = int(m.w->shape[0]), n = (O + kRows - 1) / kRows;
      if (b < n) return matmul_rows(x, *m.w, m.y, O, int(b * kRows), std::min(O, int(b * kRows + kRows)));
      b -= n;
    }
  });
}

namespace {
void check_packable(const TensorView& W) {
  if (W.dtype != DType::BF16 || W.shape.size() != 2) throw Error("pack_bf16: \"" + W.name + "\" is not a bf16 matrix");
  if (W.shape[1] % 2)
    throw Error("pack_bf16: \"" + W.name + "\" has an odd input dimension " + std::to_string(W.shape[1]));
}
}  // namespace

size_t packed_bf16_size(const TensorView& W) {
  check_packable(W);
  return size_t((W.shape[0] + kPanelRows - 1) / kPanelRows) * size_t(W.shape[1] / 2) * 32;
}

PackedBf16 pack_bf16(const TensorView& W) {
  PackedBf16 out(packed_bf16_size(W), 0);
  pack_bf16_panels(W, out.data(), 0, (W.shape[0] + kPanelRows - 1) / kPanelRows);
  return out;
}

void pack_bf16_panels(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end) {
  check_packable(W);
  active_kernels().pack_panels(W, packed, panel_begin, panel_end);
}

void round_to_bf16(float* x, int64_t n, uint16_t* bits) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = f32_to_bf16(x[i]);
    x[i] = bf16_to_f32(b);
    if (bits) bits[i] = b;
  }
}

}  // namespace r3::kernels
