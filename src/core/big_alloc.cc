#include "core/big_alloc.h"

#include <sys/mman.h>

#include <new>

namespace r3 {
namespace {
constexpr size_t kHugePage = size_t(2) << 20;
}

void* big_alloc(size_t bytes) {
  if (bytes < kHugePage) return ::operator new(bytes, std::align_val_t(64));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::operator new(rounded, std::align_val_t(kHugePage));
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: without it (or where refused) the pages are 4 KiB
  return p;
}

void big_free(void* p, size_t bytes) {
  if (bytes < kHugePage) ::operator delete(p, std::align_val_t(64));
  else ::operator delete(p, std::align_val_t(kHugePage));
}

}  // namespace r3
