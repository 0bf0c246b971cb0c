// libFuzzer entry for r3's chat-template parser and renderer (src/text/jinja.h): the input is a
// template, rendered against a small conversation under tight budgets. Build and run with
// scripts/fuzz.sh template [SECONDS]. A failure is a crash, a sanitizer report, a timeout, an
// out-of-memory, or an exception other than r3::Error escaping (std::terminate): every
// template, however hostile, must end in its text or in an r3::Error naming the line.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace r3::text::jinja;
  static const Value context = from_json(nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi é"},
                       {"role": "assistant", "content": "<think>x</think>ok", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}],
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})"));
  RenderLimits limits;  // tighter than a server's, so each input runs in milliseconds
  limits.max_steps = 200'000;
  limits.max_bytes = int64_t(16) << 20;
  limits.max_seconds = 2;
  try {
    Template t(std::string(reinterpret_cast<const char*>(data), size));
    (void)t.render(*context.dict, limits);
  } catch (const r3::Error&) {
  }
  return 0;
}
