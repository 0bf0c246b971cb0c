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
  // bf16 weights repacked for the engine's kernels (kernels/matmul.h), owned by whoever packed
  // them; null otherwise.
  const uint16_t* packed = nullptr;
  // MXFP4 [O, I]: data holds the blocks [O, I/2] bytes, scales [O, I/32] bytes.
  const uint8_t* scales = nullptr;

  int64_t numel() const;
  // Bytes the kernels read (MXFP4: blocks and scales).
  size_t nbytes() const {
    return dtype == DType::MXFP4 ? size_t(numel()) / 2 + size_t(numel()) / 32 : size_t(numel()) * dtype_size(dtype);
  }
  bool empty() const { return data == nullptr; }
  float at(int64_t i) const;          // element i (flat, C order) as fp32
  std::vector<float> to_f32() const;  // the whole tensor as fp32
  std::string shape_str() const;
};

}  // namespace r3
