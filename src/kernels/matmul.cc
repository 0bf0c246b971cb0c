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
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/u64_words.h"
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
    for (const MatmulOut& m : outs)
      matmul_rows(x, *m.w, m.y, int(m.w->shape[0]), 0, int(m.w->shape[0]));
    return;
  }
  pool->parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    int64_t first = 0;  // the current weight's first block
    for (const MatmulOut& m : outs) {
      const int O = int(m.w->shape[0]), n = (O + kRows - 1) / kRows;
      const int64_t lo = std::max(b0, first), hi = std::min(b1, first + n);
      if (lo < hi)
        matmul_rows(x, *m.w, m.y, O, int((lo - first) * kRows),
                    std::min(O, int((hi - first) * kRows)));
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
    throw Error("pack_bf16: \"" + W.name + "\" has an odd input dimension " +
                std::to_string(W.shape[1]));
  if (W.dtype == DType::F8_E4M3 &&
      (!W.scale_inv || W.block_rows < 1 || W.block_cols < 2 || W.block_cols % 2))
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

void pack_bf16_panels(const TensorView& W, uint16_t* packed, int64_t panel_begin,
                      int64_t panel_end) {
  check_packable(W);
  if (W.dtype == DType::MXFP4) return pack_mxfp4(W, packed, panel_begin, panel_end);
  if (W.dtype == DType::F8_E4M3) return pack_fp8(W, packed, panel_begin, panel_end);
  active_kernels().pack_panels(W, packed, panel_begin, panel_end);
}

namespace {
// A stored row of W, or a row of zeros for the rows past O that fill a panel's last lanes, so
// every byte of a panel is written (a refit repacks over the old panels).
const uint8_t* row_or_zeros(const uint8_t* rows, int64_t row_bytes, int64_t r, int64_t O,
                            const std::vector<uint8_t>& zeros) {
  return r < O ? rows + r * row_bytes : zeros.data();
}

// The nibbles at bits 8b of x (b = 0..7, all other bits clear) moved to bits 4b of each 32-bit
// half: bytes 0..3 give the low 16 bits, bytes 4..7 bits 32..47.
uint64_t gather_nibbles(uint64_t x) {
  x = (x | x >> 4) & 0x00FF00FF00FF00FFull;
  return (x | x >> 8) & 0x0000FFFF0000FFFFull;
}

}  // namespace

// MXFP4 [O, I] into 4-bit panels (matmul.h: groups of 16 pair rows, then their scales;
// matmul_tiles.cc decodes them). Row r's 8 code bytes of pair rows 8c..8c + 7 hold, in their low
// nibbles, the codes of inputs 2q and, in their high nibbles, of inputs 2q + 1: gathered 4 to a
// word they are row r's words 2r and 2r + 1 of lines 2c and 2c + 1, which lie next to row r + 1's.
// Rows past O are zero codes (they decode to 0).
void pack_mxfp4(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end) {
  const int64_t O = W.shape[0], I = W.shape[1], pairs = I / 2, blocks_per_row = I / 32;
  const auto* blocks = static_cast<const uint8_t*>(W.data);
  const std::vector<uint8_t> zeros(size_t(pairs), 0);
  auto* out = reinterpret_cast<uint8_t*>(packed);
  constexpr uint64_t kLowNibbles = 0x0F0F0F0F0F0F0F0Full;
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    uint8_t* panel = out + size_t(p) * mxfp4_panel_bytes(W);
    const uint8_t* rows[kPanelRows];
    for (int lane = 0; lane < kPanelRows; ++lane)
      rows[lane] = row_or_zeros(blocks, pairs, p * kPanelRows + lane, O, zeros);
    for (int64_t g = 0; g < blocks_per_row;
         ++g) {  // group by group, so each is written whole at once
      uint8_t* group = panel + size_t(g) * kMxfp4GroupBytes;
      for (int c = 0; c < kMxfp4GroupPairs / 8; ++c)
        for (int lane = 0; lane < kPanelRows; lane += 2) {
          // Per row: its words 2r, 2r + 1 of line 2c in the low half, of line 2c + 1 in the high.
          uint64_t words[2];
          for (int i = 0; i < 2; ++i) {
            const uint64_t codes = load_u64(rows[lane + i] + g * kMxfp4GroupPairs + 8 * c);
            words[i] = gather_nibbles(codes & kLowNibbles) |
                       gather_nibbles(codes >> 4 & kLowNibbles) << 16;
          }
          store_u64(group + mxfp4_code_byte(8 * c, lane, 0), low_halves(words[0], words[1]));
          store_u64(group + mxfp4_code_byte(8 * c + 4, lane, 0), high_halves(words[0], words[1]));
        }
      for (int lane = 0; lane < kPanelRows; ++lane) {
        const int64_t r = p * kPanelRows + lane;
        group[kMxfp4GroupPairs * 16 + lane] = r < O ? W.scales[r * blocks_per_row + g] : 0;
      }
    }
  }
}

// Block-scaled FP8 [O, I] into 8-bit panels (matmul.h; matmul_tiles.cc decodes them), or, for a
// block shape fp8_native refuses, into the bf16 panel of its decoded values. Rows past O, and
// the padding pair row after an odd last one, are zero (they decode to 0). Row r's 4 codes of
// inputs 4l..4l + 3 are its words 2r, 2r + 1 of pair rows 2l and 2l + 1, which line l holds as
// two 16-bit halves 8 bytes apart (fp8_code_byte).
void pack_fp8(const TensorView& W, uint16_t* packed, int64_t panel_begin, int64_t panel_end) {
  const int64_t O = W.shape[0], I = W.shape[1], pairs = I / 2,
                col_blocks = (I + W.block_cols - 1) / W.block_cols;
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
  const std::vector<uint8_t> zeros(size_t(I), 0);
  const int64_t whole = I / 8;  // 8 codes of a row: lines 2c and 2c + 1
  auto* out = reinterpret_cast<uint8_t*>(packed);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    uint8_t* panel = out + size_t(p) * panel_bytes;
    const uint8_t* rows[kPanelRows];
    for (int lane = 0; lane < kPanelRows; ++lane)
      rows[lane] = row_or_zeros(w, I, p * kPanelRows + lane, O, zeros);
    for (int64_t c = 0; c < whole; ++c)  // two lines at a time, so each is written whole at once
      for (int lane = 0; lane < kPanelRows; lane += 4) {
        // Four rows' words of pair rows 4c..4c + 3, transposed: t[k] holds pair row 4c + k's word
        // of each row, the 8 bytes fp8_code_byte puts together.
        // Pair rows 4c, 4c + 1 sit side by side in line 2c, 4c + 2, 4c + 3 a line later. Four
        // stores at fixed offsets: written as a loop over t[], GCC spilled t[] to the stack and
        // reloaded it as one vector for a scatter, a store-forwarding stall on every block
        // (BM_PackFp8 3.2 GB/s).
        uint64_t s[4], t[4];
        for (int i = 0; i < 4; ++i) s[i] = load_u64(rows[lane + i] + 8 * c);
        transpose_u16_4x4(s, t);
        static_assert(fp8_code_byte(5, 4, 0) - fp8_code_byte(4, 4, 0) == 8 &&
                      fp8_code_byte(6, 4, 0) - fp8_code_byte(4, 4, 0) == 64 &&
                      fp8_code_byte(7, 4, 0) - fp8_code_byte(4, 4, 0) == 72);
        uint8_t* at = panel + fp8_code_byte(4 * c, lane, 0);
        store_u64(at, t[0]);
        store_u64(at + 8, t[1]);
        store_u64(at + 64, t[2]);
        store_u64(at + 72, t[3]);
      }
    for (int64_t q = 4 * whole; q < (pairs + 1) / 2 * 2;
         ++q)  // the last pair rows, and a padding one
      for (int lane = 0; lane < kPanelRows; ++lane) {
        const uint8_t* at = q < pairs ? rows[lane] + 2 * q : zeros.data();
        panel[fp8_code_byte(q, lane, 0)] = at[0];
        panel[fp8_code_byte(q, lane, 1)] = at[1];
      }
    // The panel's rows lie in one row block (fp8_native): one scale per column block.
    auto* scales = reinterpret_cast<float*>(panel + fp8_scales_offset(W));
    std::memset(scales, 0, panel_bytes - fp8_scales_offset(W));
    for (int64_t b = 0; b < col_blocks; ++b)
      scales[b] = W.scale_inv[p * kPanelRows / W.block_rows * col_blocks + b];
  }
}

}  // namespace r3::kernels
