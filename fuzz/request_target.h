// One fuzz target for every request parser a client's bytes reach: the HTTP body
// (parse_body → parse_completion_request, parse_chat_request — with a small byte-level tokenizer,
// its chat template and request templates trusted, so every body renders a template within its
// budget — and parse_generate_request, plus the error reply the server would send) and a
// `r3 generate` JSONL line (json::parse → parse_request_json).
// Bad input must end in the parsers' own errors (ApiError, r3::Error; a json::exception only
// from json::parse of the JSONL line, which `r3 generate` reports as bad JSON): those are
// swallowed here. Anything else escapes — another exception type, or std::logic_error when a
// request that parsed breaks an invariant — and so do crashes, sanitizer reports and hangs.
// Driven by fuzz/request_parser_fuzz.cc (libFuzzer, scripts/fuzz.sh) and by
// tests/request_fuzz_test.cc (a bounded, seeded run in r3_tests).
#pragma once
#include <cstddef>
#include <cstdint>

namespace r3::server {

void fuzz_request_parsers(const uint8_t* data, size_t size);

}  // namespace r3::server
