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

  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  bool empty() const { return data == nullptr; }
  float at(int64_t i) const;          // element i (flat, C order) as fp32
  std::vector<float> to_f32() const;  // the whole tensor as fp32
  std::string shape_str() const;
};

}  // namespace r3
