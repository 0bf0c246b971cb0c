// Storage for the big streamed arrays (packed weights, the KV cache): 64-byte aligned, and from
// 2 MiB up aligned to 2 MiB and asked for transparent huge pages. Decode streams these arrays
// from memory; with 4 KiB pages every few KiB read is a TLB miss and a page walk, and the
// kernel here hands out huge pages only to ranges that ask (THP "madvise" mode).
#pragma once
#include <cstddef>

namespace r3 {

void* big_alloc(size_t bytes);
void big_free(void* p, size_t bytes);  // bytes: as allocated

// n uninitialised elements from big_alloc, freed with the array.
template <typename T>
class BigArray {
 public:
  explicit BigArray(size_t n) : p_(static_cast<T*>(big_alloc(n * sizeof(T)))), n_(n) {}
  ~BigArray() { big_free(p_, n_ * sizeof(T)); }
  BigArray(const BigArray&) = delete;
  BigArray& operator=(const BigArray&) = delete;
  T* get() const { return p_; }

 private:
  T* p_;
  size_t n_;
};

}  // namespace r3
