// libFuzzer entry for r3's checkpoint readers (see fuzz/checkpoint_target.h). Build and run
// with scripts/fuzz.sh checkpoint [SECONDS]; a failure is any escaping exception, a crash, a
// sanitizer report or a timeout.
#include <cstddef>
#include <cstdint>

#include "fuzz/checkpoint_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  r3::fuzz_checkpoint_readers(data, size);
  return 0;
}
