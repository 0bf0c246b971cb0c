// libFuzzer entry for r3's request parsers (see fuzz/request_target.h). Build and run with
// scripts/fuzz.sh [SECONDS]; a failure is any escaping exception (libFuzzer reports it as a
// deadly signal via std::terminate), a crash, a sanitizer report or a timeout.
#include <cstddef>
#include <cstdint>

#include "fuzz/request_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  r3::server::fuzz_request_parsers(data, size);
  return 0;
}
