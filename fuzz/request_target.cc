#include "fuzz/request_target.h"

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/request_json.h"
#include "server/api_error.h"
#include "server/chat_api.h"
#include "server/generate_api.h"
#include "server/json_fields.h"
#include "server/openai_api.h"
#include "text/pre_tokenizer.h"
#include "text/tokenizer.h"

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

// A small byte-level BPE tokenizer (GPT-2's byte alphabet, Qwen's split pattern, no merges) with
// a chat template that reads tools, for the chat path.
std::shared_ptr<const text::Tokenizer> chat_tokenizer() {
  static const std::shared_ptr<const text::Tokenizer> tok = [] {
    json vocab = json::object();
    const auto& chars = text::byte_level_chars();
    for (int b = 0; b < 256; ++b) vocab[chars[size_t(b)]] = b;
    json added = json::array();
    int next = 256;
    for (const char* s : {"<|im_start|>", "<|im_end|>"})
      added.push_back({{"id", next++},
                       {"content", s},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
    const json byte_level = {{"type", "ByteLevel"},
                             {"add_prefix_space", false},
                             {"trim_offsets", false},
                             {"use_regex", false}};
    const json tj = {{"version", "1.0"},
                     {"added_tokens", added},
                     {"normalizer", {{"type", "NFC"}}},
                     {"pre_tokenizer",
                      {{"type", "Sequence"},
                       {"pretokenizers",
                        {{{"type", "Split"},
                          {"pattern",
                           {{"Regex",
                             "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                             "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
                          {"behavior", "Isolated"},
                          {"invert", false}},
                         byte_level}}}},
                     {"post_processor", byte_level},
                     {"decoder", byte_level},
                     {"model",
                      {{"type", "BPE"},
                       {"dropout", nullptr},
                       {"unk_token", nullptr},
                       {"fuse_unk", false},
                       {"byte_fallback", false},
                       {"ignore_merges", false},
                       {"vocab", vocab},
                       {"merges", json::array()}}}};
    const json cfg = {
        {"eos_token", "<|im_end|>"},
        {"chat_template",
         "{%- if tools %}{{ tools | tojson(indent=2) }}{% endif %}{%- for m in messages %}"
         "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] if m['content'] is string else "
         "m['content'] | tojson) "
         "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt "
         "%}<|im_start|>assistant\n{% endif %}"}};
    return std::shared_ptr<const text::Tokenizer>(
        text::Tokenizer::from_json(tj.dump(), cfg.dump(), "fuzz tokenizer"));
  }();
  return tok;
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
      for (const Job& j : r.jobs)
        check(!j.prompt.empty() && j.params.max_tokens >= 0, "completion: job fields");
    });
    expect_parser_errors([&] {  // POST /v1/chat/completions, request templates trusted
      ChatTemplatePolicy policy;
      policy.trust_request_chat_template = true;
      const CompletionRequest r =
          parse_chat_request(b, body, seeds, chat_tokenizer(), 4096, policy);
      check(r.chat && r.num_prompts == 1 && r.jobs.size() == r.n, "chat: one prompt, n jobs");
    });
    expect_parser_errors([&] {
      const GenerateRequest r = parse_generate_request(b, seeds);
      check(!r.jobs.empty() && (r.batch || r.jobs.size() == 1), "generate: job count");
      for (const Job& j : r.jobs)
        check(!j.prompt.empty() && j.params.max_tokens >= 0, "generate: job fields");
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
