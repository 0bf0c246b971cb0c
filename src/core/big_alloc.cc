#include "core/big_alloc.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <new>

namespace r3 {
namespace {
constexpr size_t kHugePage = size_t(2) << 20;
size_t rounded_to_huge_pages(size_t bytes) {
  return (bytes + kHugePage - 1) / kHugePage * kHugePage;
}
}  // namespace

void* big_alloc(size_t bytes, bool zeroed) {
  if (bytes < kHugePage) {
    void* p = ::operator new(bytes, std::align_val_t(64));
    if (zeroed) std::memset(p, 0, bytes);
    return p;
  }
  // Anonymous pages straight from the kernel: zero-filled on first touch, so nothing is written
  // (or committed) here. One huge page more than asked, then the unaligned ends unmapped.
  const size_t rounded = rounded_to_huge_pages(bytes);
  void* raw = mmap(nullptr, rounded + kHugePage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  if (const size_t tail = start + rounded + kHugePage - (aligned + rounded); tail > 0)
    munmap(reinterpret_cast<void*>(aligned + rounded), tail);
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: without it (or where refused) the pages are 4 KiB
  return p;
}

void big_free(void* p, size_t bytes) {
  if (!p) return;
  if (bytes < kHugePage)
    ::operator delete(p, std::align_val_t(64));
  else
    munmap(p, rounded_to_huge_pages(bytes));
}

}  // namespace r3
