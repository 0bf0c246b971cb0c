// r3's chat-template renderer against python3-jinja2 in Hugging Face's apply_chat_template
// environment: the real templates of Qwen3, DeepSeek-V3 and Llama 3 and a Mixtral-style [INST]
// template, on seeded conversations (system/user/assistant/tool turns, tool calls, tools,
// reasoning, thinking on and off), must render byte for byte the same, and raise where Jinja
// raises. The oracle comes from scripts/tokenizer_oracle.sh; without it these tests skip.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/jinja.h"

namespace r3::text::jinja {
namespace {

namespace fs = std::filesystem;

TEST(ChatTemplateOracle, RendersByteForByteAsJinja) {
  const char* dir = std::getenv("R3_TOKENIZER_ORACLE");
  if (!dir || !fs::exists(fs::path(dir) / "chat.json"))
    GTEST_SKIP() << "R3_TOKENIZER_ORACLE is not set (scripts/tokenizer_oracle.sh writes it)";
  std::ifstream f(fs::path(dir) / "chat.json");
  const nlohmann::ordered_json cases = nlohmann::ordered_json::parse(f);
  std::map<std::string, std::unique_ptr<Template>> compiled;
  std::map<std::string, int> counts;
  int bad = 0;
  for (size_t i = 0; i < cases.size() && bad < 10; ++i) {
    const auto& c = cases[i];
    const std::string name = c["template"];
    if (!compiled.count(name))
      compiled[name] = std::make_unique<Template>(c["source"].get<std::string>());
    const Value ctx = from_json(c["context"]);
    std::string got, error;
    try {
      got = compiled[name]->render(*ctx.dict);
    } catch (const Error& e) {
      error = e.what();
    }
    ++counts[name];
    if (!c["error"].is_null()) {
      if (error.find(c["error"].get<std::string>()) == std::string::npos) {
        ++bad;
        ADD_FAILURE() << name << " case " << i << ": Jinja raised \""
                      << c["error"].get<std::string>() << "\", r3 gave "
                      << (error.empty() ? "\"" + got + "\"" : "error \"" + error + "\"");
      }
      continue;
    }
    if (!error.empty() || got != c["output"].get<std::string>()) {
      ++bad;
      ADD_FAILURE() << name << " case " << i << " differs\n  context: " << c["context"].dump()
                    << "\n  r3:    "
                    << nlohmann::json(error.empty() ? got : "ERROR " + error).dump()
                    << "\n  jinja: " << c["output"].dump();
    }
  }
  EXPECT_EQ(bad, 0);
  for (const auto& [name, n] : counts)
    std::printf("[ %s ] %d renderings compared\n", name.c_str(), n);
}

}  // namespace
}  // namespace r3::text::jinja
