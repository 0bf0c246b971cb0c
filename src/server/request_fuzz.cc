#include "server/request_fuzz.h"

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/request_json.h"
#include "server/api_error.h"
#include "server/generate_api.h"
#include "server/json_fields.h"
#include "server/openai_api.h"

namespace r3::server {

using json = nlohmann::json;

namespace {

void check(bool ok, const char* what) {
  if (!ok) throw std::logic_error(std::string("request fuzz: broken invariant: ") + what);
}

// What the server does with a parser's error: the JSON error reply must serialize.
void reply_with(const ApiError& e) {
  check(e.status() >= 400 && e.status() < 600, "an ApiError status is 4xx/5xx");
  (void)error_body(e).dump(-1, ' ', false, json::error_handler_t::replace);
}

template <typename F>
void expect_parser_errors(F&& f) {
  try {
    f();
  } catch (const ApiError& e) {
    reply_with(e);
  } catch (const Error& e) {
    reply_with(bad_request(e.what()));
  }
}

}  // namespace

void fuzz_request_parsers(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  uint64_t next_seed = 1;
  const auto seeds = [&next_seed] { return next_seed++; };

  // The HTTP path: POST /v1/completions and POST /generate.
  expect_parser_errors([&] {
    const json b = parse_body(body);
    check(b.is_object(), "parse_body returns an object");
    expect_parser_errors([&] {
      const CompletionRequest r = parse_completion_request(b, seeds);
      check(r.num_prompts > 0 && r.n >= 1 && r.n <= 256, "completion: prompt and choice counts");
      check(r.jobs.size() == r.num_prompts * r.n, "completion: one job per prompt and sample");
      check(r.prompt_lens.size() == r.num_prompts, "completion: one length per prompt");
      for (const Job& j : r.jobs) check(!j.prompt.empty() && j.params.max_tokens >= 0, "completion: job fields");
    });
    expect_parser_errors([&] {
      const GenerateRequest r = parse_generate_request(b, seeds);
      check(!r.jobs.empty() && (r.batch || r.jobs.size() == 1), "generate: job count");
      for (const Job& j : r.jobs) check(!j.prompt.empty() && j.params.max_tokens >= 0, "generate: job fields");
    });
  });

  // The `r3 generate` path: one JSONL line.
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception&) {
    return;  // malformed JSON: `r3 generate` reports the line
  }
  expect_parser_errors([&] { (void)parse_request_json(j); });
}

}  // namespace r3::server
