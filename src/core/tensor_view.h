// A read-only view of one tensor in memory someone else owns (a checkpoint, a trainer's buffer):
// what the kernels and the forwards compute with. Knows nothing of file formats; `file` only
// names where the bytes came from in error messages.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace r3 {

struct TensorView {
  std::string name, file;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  // The weight as the engine's kernels read it (core/panel_layout.h), owned by whoever packed it
  // (the checkpoint: then data is null, the panels being the only copy); null otherwise.
  const uint16_t* packed = nullptr;
  // MXFP4 [O, I]: data holds the blocks [O, I/2] bytes, scales [O, I/32] bytes.
  const uint8_t* scales = nullptr;
  // F8_E4M3 [O, I] block-scaled: element (o, i) is its e4m3 value times (an fp32 product)
  // scale_inv[o / block_rows][i / block_cols], scale_inv [ceil(O / block_rows), ceil(I /
  // block_cols)]. Null for the stored tensor itself (a weight_scale_inv sibling holds the scales).
  const float* scale_inv = nullptr;
  int block_rows = 0, block_cols = 0;

  int64_t numel() const;
  // Block scales of a block-scaled F8_E4M3 view (0 otherwise).
  int64_t num_block_scales() const {
    if (!scale_inv) return 0;
    return (shape[0] + block_rows - 1) / block_rows * ((shape[1] + block_cols - 1) / block_cols);
  }
  // Bytes the kernels read (MXFP4: blocks and scales; FP8: values and block scales).
  size_t nbytes() const {
    if (dtype == DType::MXFP4) return size_t(numel()) / 2 + size_t(numel()) / 32;
    return size_t(numel()) * dtype_size(dtype) + size_t(num_block_scales()) * 4;
  }
  // No bytes and no panels: an absent optional tensor, or another rank's expert.
  bool empty() const { return data == nullptr && packed == nullptr; }
  // Element i (flat, C order) as fp32: from the stored bytes, or read back from the packed
  // panels when those are the only copy (core/panel_layout.h).
  float at(int64_t i) const;
  std::vector<float> to_f32() const;  // the whole tensor as fp32
  std::string shape_str() const;
};

// The first element of a float tensor (F32, BF16, F16) whose exponent bits are all ones (NaN or
// infinity), or -1; -1 for other dtypes and for a view without stored bytes.
int64_t first_non_finite(const TensorView& t);

}  // namespace r3
