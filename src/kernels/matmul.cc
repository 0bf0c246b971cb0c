// The matmul entry points that do not depend on the instruction set: splitting the rows over the
// pool, packing bf16 weights, rounding activations. The tiles are in matmul_tiles.cc.
#include "kernels/matmul.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
  // line and let the kernel take its widest tile; the blocks of every weight form one job. Every
  // block has the same inputs, so blocks cost alike and each thread takes a contiguous share:
  // within it the kernel's passes prefetch one another (matmul_tiles.cc), where blocks handed
  // out one at a time each began on memory misses (batch-1 decode 5% slower side by side).
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
  pool->parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    int64_t first = 0;  // the current weight's first block
    for (const MatmulOut& m : outs) {
      const int O = int(m.w->shape[0]), n = (O + kRows - 1) / kRows;
      const int64_t lo = std::max(b0, first), hi = std::min(b1, first + n);
      if (lo < hi) matmul_rows(x, *m.w, m.y, O, int((lo - first) * kRows), std::min(O, int((hi - first) * kRows)));
      first += n;
    }
  });
}

void prefetch_rows_start(const TensorView& W, int o_begin, int o_end) {
#if defined(__x86_64__)
  if (!W.packed || o_begin >= o_end) return;
  const size_t panel_bytes = packed_panel_bytes(W);
  constexpr size_t kStartBytes = 2048;  // the bf16 tiles' prefetch distance (32 pair rows)
  const auto* packed = reinterpret_cast<const char*>(W.packed);
  const int p0 = o_begin / kPanelRows, p1 = std::min((o_end + kPanelRows - 1) / kPanelRows, p0 + 4);
  for (int p = p0; p < p1; ++p)
    for (size_t at = 0; at < std::min(kStartBytes, panel_bytes); at += 64)
      _mm_prefetch(packed + size_t(p) * panel_bytes + at, _MM_HINT_T1);
#else
  (void)W, (void)o_begin, (void)o_end;
#endif
}

void pack_mxfp4(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end);
void pack_fp8(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end);

namespace {
void check_packable(const TensorView& W) {
  if (!packable(W.dtype) || W.shape.size() != 2)
    throw Error("pack_bf16: \"" + W.name + "\" is not a bf16, MXFP4 or FP8 matrix");
  if (W.shape[1] % 2)
    throw Error("pack_bf16: \"" + W.name + "\" has an odd input dimension " + std::to_string(W.shape[1]));
  if (W.dtype == DType::F8_E4M3 && (!W.scale_inv || W.block_rows < 1 || W.block_cols < 2 || W.block_cols % 2))
    throw Error("pack_bf16: FP8 \"" + W.name + "\" has no block scales with an even column block");
}
}  // namespace

size_t packed_bf16_size(const TensorView& W) {
  check_packable(W);
  const size_t panels = size_t((W.shape[0] + kPanelRows - 1) / kPanelRows);
  return panels * packed_panel_bytes(W) / 2;  // in uint16_t elements
}

PackedBf16 pack_bf16(const TensorView& W) {
  PackedBf16 out(packed_bf16_size(W), 0);
  pack_bf16_panels(W, out.data(), 0, (W.shape[0] + kPanelRows - 1) / kPanelRows);
  return out;
}

void pack_bf16_panels(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end) {
  check_packable(W);
  if (W.dtype == DType::MXFP4) return pack_mxfp4(W, packed, panel_begin, panel_end);
  if (W.dtype == DType::F8_E4M3) return pack_fp8(W, packed, panel_begin, panel_end);
  active_kernels().pack_panels(W, packed, panel_begin, panel_end);
}

// MXFP4 [O, I] into 4-bit panels (matmul.h: groups of 16 pair rows, then their scales; matmul_tiles.cc
// decodes them). Rows past O stay zero bytes (they decode to 0).
void pack_mxfp4(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end) {
  const int64_t O = W.shape[0], I = W.shape[1], pairs = I / 2, blocks_per_row = I / 32;
  const auto* blocks = static_cast<const uint8_t*>(W.data);
  auto* out = reinterpret_cast<uint8_t*>(packed);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    uint8_t* panel = out + size_t(p) * mxfp4_panel_bytes(W);
    std::memset(panel, 0, mxfp4_panel_bytes(W));  // two codes share a byte: they are or-ed in
    for (int64_t r = p * kPanelRows; r < std::min(O, (p + 1) * kPanelRows); ++r) {
      const int lane = int(r - p * kPanelRows);
      for (int64_t g = 0; g < blocks_per_row; ++g) {
        uint8_t* group = panel + size_t(g) * kMxfp4GroupBytes;
        for (int j = 0; j < kMxfp4GroupPairs; ++j) {
          const uint8_t codes = blocks[r * pairs + g * kMxfp4GroupPairs + j];  // input 2q low nibble, 2q + 1 high
          for (int h = 0; h < 2; ++h)
            group[mxfp4_code_byte(j, lane, h)] |= uint8_t(((codes >> (4 * h)) & 15) << mxfp4_code_shift(j));
        }
        group[kMxfp4GroupPairs * 16 + lane] = W.scales[r * blocks_per_row + g];
      }
    }
  }
}

// Block-scaled FP8 [O, I] into 8-bit panels (matmul.h; matmul_tiles.cc decodes them), or, for a
// block shape fp8_native refuses, into the bf16 panel of its decoded values. Rows past O, and
// the padding pair row after an odd last one, stay zero (they decode to 0).
void pack_fp8(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end) {
  const int64_t O = W.shape[0], I = W.shape[1], pairs = I / 2, col_blocks = (I + W.block_cols - 1) / W.block_cols;
  if (!fp8_native(W)) {
    for (int64_t p = panel_begin; p < panel_end; ++p) {
      uint16_t* panel = packed + size_t(p) * size_t(pairs) * 32;
      std::memset(panel, 0, size_t(pairs) * 64);
      for (int64_t r = p * kPanelRows; r < std::min(O, (p + 1) * kPanelRows); ++r)
        for (int64_t k = 0; k < I; ++k)
          panel[(k / 2) * 32 + (r - p * kPanelRows) * 2 + k % 2] = f32_to_bf16(W.at(r * I + k));
    }
    return;
  }
  const size_t panel_bytes = fp8_panel_bytes(W);
  const auto* w = static_cast<const uint8_t*>(W.data);
  auto* out = reinterpret_cast<uint8_t*>(packed);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    uint8_t* panel = out + size_t(p) * panel_bytes;
    std::memset(panel, 0, panel_bytes);
    for (int64_t r = p * kPanelRows; r < std::min(O, (p + 1) * kPanelRows); ++r) {
      const int lane = int(r - p * kPanelRows);
      for (int64_t k = 0; k < I; ++k) panel[fp8_code_byte(k / 2, lane, int(k % 2))] = w[r * I + k];
    }
    // The panel's rows lie in one row block (fp8_native): one scale per column block.
    auto* scales = reinterpret_cast<float*>(panel + fp8_scales_offset(W));
    for (int64_t b = 0; b < col_blocks; ++b) scales[b] = W.scale_inv[p * kPanelRows / W.block_rows * col_blocks + b];
  }
}

}  // namespace r3::kernels
