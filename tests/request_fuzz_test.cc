// A bounded, deterministic fuzz run of the request parsers in the normal test binary (the
// libFuzzer target is scripts/fuzz.sh). Seeded mutations of the seed corpus — byte flips,
// insertions, deletions, splices of JSON fragments, huge numbers, deep nesting, wrong types,
// unicode — go through fuzz_request_parsers, which lets only the parsers' expected errors pass;
// anything else that escapes fails the test with the input that caused it.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz/request_target.h"
#include "server/api_error.h"
#include "server/generate_api.h"
#include "server/json_fields.h"
#include "server/openai_api.h"

namespace r3 {
namespace {

using json = nlohmann::json;
using server::fuzz_request_parsers;

constexpr size_t kMaxLen = 4096;  // as scripts/fuzz.sh's -max_len

// Kept in step with fuzz/corpus/ (read too, when the source tree is at hand).
std::vector<std::string> seed_corpus() {
  std::vector<std::string> seeds = {
      R"({"model":"m","prompt":[1,2,3,4],"max_tokens":8,"temperature":0.7,"top_p":0.9,"seed":7})",
      R"({"prompt":[[5,6,7],[8,9]],"n":2,"max_tokens":4,"stream":true,"logprobs":1,"stop_token_ids":[2],)"
      R"("return_routed_experts":true,"routed_experts_start":1,"request_id":"abc"})",
      R"({"prompt":[11,12],"max_tokens":16,"top_k":-1,"ignore_eos":true,"logprobs":true,"return_token_ids":true,)"
      R"("best_of":1,"presence_penalty":0,"frequency_penalty":0.0,"repetition_penalty":1,"echo":false,)"
      R"("suffix":"","logit_bias":{},"stop":[],"user":"u\u00e9"})",
      R"({"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":8,"temperature":0,"top_p":1.0,"top_k":20,)"
      R"("stop_token_ids":[0],"seed":3},"return_routed_experts":true,"rid":"r-1"})",
      R"({"input_ids":[[1,2],[3,4,5]],"sampling_params":{"max_new_tokens":2,"ignore_eos":true,"sampling_seed":9,)"
      R"("n":1,"min_new_tokens":0,"stop":null},"return_logprob":false,"rid":42,"routed_experts_start":0,"stream":false})",
      R"({"prompt_token_ids":[1,2,3],"max_tokens":4,"temperature":1.0,"top_p":0.95,"top_k":5,"seed":1,)"
      R"("stop_token_ids":[7],"ignore_eos":false,"logprobs":true,"return_routed_experts":true,"routed_experts_start":0})",
      R"({"prompt_token_ids":[9],"max_new_tokens":1})",
  };
  const auto dir = std::filesystem::path(__FILE__).parent_path().parent_path() / "fuzz" / "corpus";
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) {
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());  // deterministic order
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      seeds.push_back(ss.str());
    }
  }
  return seeds;
}

const std::vector<std::string> kKeys = {"prompt",
                                        "input_ids",
                                        "prompt_token_ids",
                                        "sampling_params",
                                        "max_tokens",
                                        "max_new_tokens",
                                        "temperature",
                                        "top_p",
                                        "top_k",
                                        "seed",
                                        "sampling_seed",
                                        "stop",
                                        "stop_token_ids",
                                        "ignore_eos",
                                        "logprobs",
                                        "return_logprob",
                                        "return_token_ids",
                                        "return_routed_experts",
                                        "routed_experts_start",
                                        "request_id",
                                        "rid",
                                        "n",
                                        "best_of",
                                        "stream",
                                        "echo",
                                        "suffix",
                                        "logit_bias",
                                        "presence_penalty",
                                        "frequency_penalty",
                                        "repetition_penalty",
                                        "min_new_tokens",
                                        "regex",
                                        "json_schema",
                                        "text"};

// Values of every JSON type, at and past the parsers' range limits, and odd strings.
const std::vector<std::string> kFragments = {"0",
                                             "1",
                                             "-1",
                                             "256",
                                             "257",
                                             "2147483647",
                                             "2147483648",
                                             "-2147483648",
                                             "-2147483649",
                                             "9223372036854775807",
                                             "9223372036854775808",
                                             "-9223372036854775808",
                                             "-9223372036854775809",
                                             "18446744073709551615",
                                             "18446744073709551616",
                                             "99999999999999999999999999999",
                                             "1e308",
                                             "-1e308",
                                             "1e309",
                                             "1e-400",
                                             "0.5",
                                             "-0",
                                             "-0.0",
                                             "1.0",
                                             "3.4e38",
                                             "3.5e38",
                                             "true",
                                             "false",
                                             "null",
                                             "[]",
                                             "{}",
                                             "[[]]",
                                             "[{}]",
                                             "[null]",
                                             "[1,[2]]",
                                             "[[1],2]",
                                             "[[1],[]]",
                                             "[\"a\"]",
                                             "[\"a\",1]",
                                             "[1.5]",
                                             "[true]",
                                             "\"\"",
                                             "\"x\"",
                                             "\"\\u0000\"",
                                             "\"\\ud800\"",
                                             "\"\\udc00\\ud800\"",
                                             "\"\\ud83d\\ude00\"",
                                             "\"\xc3\xa9\"",
                                             "\"\xff\xfe\"",
                                             "\"\xed\xa0\x80\"",
                                             "\"\xf4\x90\x80\x80\"",
                                             "\"\xc0\x80\"",
                                             "\"\\\"",
                                             "\"\\x\"",
                                             "\xef\xbb\xbf",
                                             "{\"a\":1}",
                                             "{\"max_new_tokens\":1}",
                                             "[[1,2],[3]]",
                                             "[-1,2147483648]",
                                             ",",
                                             ":",
                                             "[",
                                             "]",
                                             "{",
                                             "}",
                                             "\"",
                                             "\\",
                                             "/*",
                                             "NaN",
                                             "Infinity",
                                             "0x10",
                                             "01",
                                             ".5",
                                             "1.",
                                             "+1",
                                             "1e",
                                             "\t",
                                             "\n",
                                             " "};

std::string nested(size_t depth, bool objects, bool closed) {
  std::string s;
  for (size_t i = 0; i < depth; ++i) s += objects ? "{\"a\":" : "[";
  s += "1";
  if (closed) s += std::string(depth, objects ? '}' : ']');
  return s;
}

class Mutator {
 public:
  Mutator(uint64_t seed, std::vector<std::string> seeds) : rng_(seed), seeds_(std::move(seeds)) {}

  std::string next() {
    std::string s = pick(seeds_);
    const int rounds = 1 + int(below(4));
    for (int i = 0; i < rounds; ++i) s = mutate(std::move(s));
    if (s.size() > kMaxLen) s.resize(kMaxLen);
    return s;
  }

 private:
  uint64_t below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[below(v.size())];
  }
  size_t pos(const std::string& s) { return below(s.size() + 1); }

  std::string random_value() {
    switch (below(6)) {
      case 0:
        return nested(1 + below(300), below(2), below(4) != 0);
      case 1: {  // a long list of ids, or a list of lists
        std::string s = "[";
        const size_t n = 1 + below(200);
        const bool lists = below(2);
        for (size_t i = 0; i < n; ++i)
          s += (i ? "," : "") +
               (lists ? "[" + std::to_string(below(5)) + "]" : std::to_string(below(100)));
        return s + "]";
      }
      case 2:
        return std::to_string(int64_t(rng_()));
      case 3:
        return std::to_string(rng_()) + std::string(below(30), '9');
      default:
        return pick(kFragments);
    }
  }

  std::string mutate(std::string s) {
    switch (below(10)) {
      case 0:  // bit flip
        if (!s.empty()) s[below(s.size())] ^= char(1u << below(8));
        return s;
      case 1:  // a random byte
        if (!s.empty()) s[below(s.size())] = char(below(256));
        return s;
      case 2:  // insert random bytes
        return s.insert(pos(s), std::string(1 + below(4), char(below(256))));
      case 3: {  // delete a range
        if (s.empty()) return s;
        const size_t a = below(s.size());
        return s.erase(a, 1 + below(std::min<size_t>(s.size() - a, 16)));
      }
      case 4:  // insert a JSON fragment anywhere
        return s.insert(pos(s), pick(kFragments));
      case 5: {  // replace what follows a ':' with another value
        std::vector<size_t> colons;
        for (size_t i = 0; i < s.size(); ++i)
          if (s[i] == ':') colons.push_back(i);
        if (colons.empty()) return s.insert(pos(s), random_value());
        const size_t c = pick(colons) + 1;
        size_t e = c;
        int depth = 0;
        while (e < s.size() && !(depth == 0 && (s[e] == ',' || s[e] == '}'))) {
          if (s[e] == '[' || s[e] == '{') ++depth;
          if (s[e] == ']' || s[e] == '}') --depth;
          ++e;
        }
        return s.replace(c, e - c, random_value());
      }
      case 6: {  // splice with another seed
        const std::string& o = pick(seeds_);
        return s.substr(0, pos(s)) + o.substr(below(o.size() + 1));
      }
      case 7: {  // add a key (possibly a duplicate) after an opening brace
        const size_t b = s.find('{', below(s.size() + 1));
        const size_t at = b == std::string::npos ? s.find('{') : b;
        if (at == std::string::npos) return s;
        return s.insert(at + 1, "\"" + pick(kKeys) + "\":" + random_value() + ",");
      }
      case 8: {  // structured: a known field set to an arbitrary value, top level or in
                 // sampling_params
        json j = json::parse(s, nullptr, false);
        if (!j.is_object()) return s;
        json v = json::parse(random_value(), nullptr, false);
        if (v.is_discarded()) v = pick(kKeys);
        json& target =
            below(3) == 0 && j.contains("sampling_params") && j["sampling_params"].is_object()
                ? j["sampling_params"]
                : j;
        if (below(5) == 0)
          target.erase(pick(kKeys));
        else
          target[pick(kKeys)] = v;
        return j.dump();
      }
      default: {  // unicode: a valid or invalid UTF-8 sequence, or an escape
        static const std::vector<std::string> u = {
            "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xff",    "\xc3", "\xed\xa0\x80",
            "\\u00e9",  "\\ud800",      "\\uDFFF",          "\\u0000", "\x00", "\xef\xbb\xbf"};
        return s.insert(pos(s), pick(u));
      }
    }
  }

  std::mt19937_64 rng_;
  std::vector<std::string> seeds_;
};

std::string printable(const std::string& s) {
  std::string o;
  for (unsigned char c : s.substr(0, 400)) {
    if (c >= 0x20 && c < 0x7f)
      o += char(c);
    else {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      o += b;
    }
  }
  return s.size() > 400 ? o + "... (" + std::to_string(s.size()) + " bytes)" : o;
}

// Feeds one input; a failure names the input.
bool survives(const std::string& in) {
  try {
    fuzz_request_parsers(reinterpret_cast<const uint8_t*>(in.data()), in.size());
    return true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception: " << e.what() << "\ninput: " << printable(in);
  } catch (...) {
    ADD_FAILURE() << "unexpected non-std exception\ninput: " << printable(in);
  }
  return false;
}

TEST(RequestFuzz, SeedCorpusParses) {
  for (const std::string& s : seed_corpus()) EXPECT_TRUE(survives(s));
  EXPECT_TRUE(survives(""));
}

TEST(RequestFuzz, SeededMutations) {
  const std::vector<std::string> seeds = seed_corpus();
  Mutator m(0x5eed, seeds);
  const auto start = std::chrono::steady_clock::now();
  const auto budget = std::chrono::seconds(4);  // a cap for slow (sanitized, shared) machines
  size_t runs = 0, failures = 0;
  for (; runs < 20000 && failures < 5; ++runs) {
    if (!survives(m.next())) ++failures;
    if ((runs & 255) == 0 && std::chrono::steady_clock::now() - start > budget) break;
  }
  EXPECT_GE(runs, 1000u) << "too few inputs in the time budget";
  std::printf("[ RequestFuzz ] %zu inputs in %.2f s\n", runs,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

// nlohmann's parser and destructor are iterative, so depth alone must not overflow the stack.
TEST(RequestFuzz, DeepNesting) {
  constexpr size_t kDepth = 100000;
  EXPECT_TRUE(survives(std::string(kDepth, '[')));
  EXPECT_TRUE(survives(std::string(kDepth, '{')));
  EXPECT_TRUE(survives(nested(kDepth, false, true)));
  EXPECT_TRUE(survives(nested(kDepth, true, true)));
  for (const char* key : {"prompt", "input_ids", "prompt_token_ids", "stop_token_ids", "logit_bias",
                          "stop", "sampling_params", "rid"}) {
    EXPECT_TRUE(survives("{\"" + std::string(key) + "\":" + nested(kDepth, false, true) + "}"))
        << key;
    EXPECT_TRUE(survives("{\"" + std::string(key) + "\":" + nested(kDepth, true, true) + "}"))
        << key;
    EXPECT_TRUE(survives("{\"input_ids\":[1],\"sampling_params\":{\"" + std::string(key) +
                         "\":" + nested(kDepth, false, true) + "}}"))
        << key;
  }
}

TEST(RequestFuzz, EdgeCases) {
  for (const std::string& s : std::vector<std::string>{
           "{\"prompt\":[1],\"max_tokens\":18446744073709551615}",
           "{\"prompt\":[18446744073709551615]}",
           "{\"prompt\":[-9223372036854775808]}",
           "{\"prompt\":[1],\"seed\":18446744073709551615,\"n\":256}",
           "{\"prompt\":[1],\"temperature\":1e308,\"top_p\":-1e308}",
           "{\"prompt\":[1],\"logprobs\":18446744073709551615}",
           "{\"input_ids\":[1],\"rid\":18446744073709551615}",
           "{\"input_ids\":[1],\"sampling_params\":{\"seed\":-1}}",
           "{\"prompt_token_ids\":[18446744073709551615],\"max_tokens\":9223372036854775808}",
           "{\"prompt_token_ids\":[1],\"temperature\":1e308,\"seed\":-1}",
           "{\"prompt\":\"\xff\"}",
           "{\"prompt\":\"\xff\xfe\"",
           "\xff{}",
           "{\"prompt\":[1]}\xff",
           std::string("{\"prompt\":[1]\0}", 15),
           "{\"prompt\":[1],\"prompt\":[2]}",
       })
    EXPECT_TRUE(survives(s));
}

std::string id_lists(size_t count, const std::string& one) {
  std::string s = "[";
  for (size_t i = 0; i < count; ++i) s += (i ? "," : "") + one;
  return s + "]";
}

// Found by fuzzing: every choice copies its prompt and stop_token_ids, so a 4 KB body
// ({"n":256, 480 one-id prompts, 1000 stop ids}) expanded to ~0.5 GB of ids, and a 16 MB one
// to far more than any machine has. The parsers now refuse such requests with a 400.
TEST(RequestFuzz, ExpansionIsBounded) {
  const auto seeds = [] { return uint64_t(1); };
  const std::string stops = id_lists(1000, "0");
  const json amp = server::parse_body(R"({"n":256,"prompt":)" + id_lists(480, "[0]") +
                                      R"(,"stop_token_ids":)" + stops + "}");
  try {
    server::parse_completion_request(amp, seeds);
    ADD_FAILURE() << "an expanding /v1/completions body was accepted";
  } catch (const server::ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_NE(std::string(e.what()).find("too large"), std::string::npos) << e.what();
  }
  const json gamp = server::parse_body(R"({"input_ids":)" + id_lists(20000, "[0]") +
                                       R"(,"sampling_params":{"stop_token_ids":)" + stops + "}}");
  EXPECT_THROW(server::parse_generate_request(gamp, seeds), server::ApiError);
  const json many = server::parse_body(R"({"input_ids":)" + id_lists(70000, "[0]") + "}");
  EXPECT_THROW(server::parse_generate_request(many, seeds), server::ApiError);

  // A large but ordinary batch still parses: 64 prompts of 512 ids, n = 16, a few stop ids.
  const std::string prompt = id_lists(512, "7");
  const json big = server::parse_body(R"({"n":16,"prompt":)" + id_lists(64, prompt) +
                                      R"(,"stop_token_ids":[1,2,3]})");
  EXPECT_EQ(server::parse_completion_request(big, seeds).jobs.size(), 64u * 16u);
  const json gbig = server::parse_body(R"({"input_ids":)" + id_lists(1024, prompt) +
                                       R"(,"sampling_params":{"stop_token_ids":[1,2,3]}})");
  EXPECT_EQ(server::parse_generate_request(gbig, seeds).jobs.size(), 1024u);
}

}  // namespace
}  // namespace r3
