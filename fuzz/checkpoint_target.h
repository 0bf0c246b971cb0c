// One fuzz target for the readers a checkpoint's bytes reach: the safetensors reader (header
// length, header JSON, offsets, dtypes, shapes) and the config.json parser. The first input byte
// chooses: even = the rest is a safetensors file, odd = the rest is config.json text. Bad input
// must end in r3::Error (swallowed here); anything else escapes: another exception type, a
// crash, a sanitizer report or a hang. Driven by fuzz/checkpoint_fuzz.cc (libFuzzer,
// `scripts/fuzz.sh checkpoint`) and by tests/checkpoint_fuzz_test.cc (a bounded, seeded run).
#pragma once
#include <cstddef>
#include <cstdint>

namespace r3 {

void fuzz_checkpoint_readers(const uint8_t* data, size_t size);

}  // namespace r3
