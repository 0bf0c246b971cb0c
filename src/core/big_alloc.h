// Storage for the big streamed arrays (packed weights, the KV cache): 64-byte aligned, and from
// 2 MiB up aligned to 2 MiB and asked for transparent huge pages. Decode streams these arrays
// from memory; with 4 KiB pages every few KiB read is a TLB miss and a page walk, and the
// kernel here hands out huge pages only to ranges that ask (THP "madvise" mode).
// From 2 MiB up the memory is the kernel's anonymous pages, which it zero-fills when they are
// first touched: zeroed memory costs nothing until it is written, and is committed only where
// it is (a KV cache of many GiB starts, and resumes after a release, at once).
#pragma once
#include <cstddef>

namespace r3 {

// bytes of memory, zero-filled when `zeroed` (else its contents are unspecified); throws
// std::bad_alloc when the system has no room for the range.
void* big_alloc(size_t bytes, bool zeroed = false);
void big_free(void* p, size_t bytes);  // bytes: as allocated

// Marks a BigArray whose elements start as zero bits.
struct ZeroFilled {};

// n elements from big_alloc, uninitialised (or zero bits: ZeroFilled), freed with the array.
template <typename T>
class BigArray {
 public:
  explicit BigArray(size_t n) : p_(static_cast<T*>(big_alloc(n * sizeof(T)))), n_(n) {}
  BigArray(size_t n, ZeroFilled) : p_(static_cast<T*>(big_alloc(n * sizeof(T), true))), n_(n) {}
  ~BigArray() { big_free(p_, n_ * sizeof(T)); }
  BigArray(const BigArray&) = delete;
  BigArray& operator=(const BigArray&) = delete;
  T* get() const { return p_; }

 private:
  T* p_;
  size_t n_;
};

}  // namespace r3
