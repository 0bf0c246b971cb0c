// r3 tokenize: a Hugging Face tokenizer (tokenizer.json) from the command line: encode text to
// ids, decode ids to text, or time encoding over a corpus.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "core/seconds_since.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

namespace r3::cli {

using json = nlohmann::json;

int cmd_tokenize(int argc, char** argv) {
  Args a("tokenize",
         "Encodes text with a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json in\n"
         "--tokenizer, a checkpoint directory or a tokenizer's own), or decodes ids.\n"
         "  r3 tokenize --tokenizer DIR --text 'Hello'         prints the ids as JSON\n"
         "  r3 tokenize --tokenizer DIR --decode '[9707, 0]'    prints the text\n"
         "  r3 tokenize --tokenizer DIR --bench CORPUS.json     encode throughput over a JSON list "
         "of strings");
  a.opt("tokenizer", "", "directory with tokenizer.json")
      .opt("text", "",
           "text to encode (default: standard input, when neither --decode nor --bench is given)")
      .opt("decode", "", "a JSON list of ids to decode")
      .opt("bench", "", "a JSON list of strings: encode them all (best of --reps) and print MB/s")
      .opt("reps", "3", "repetitions of --bench")
      .opt("bench-chat", "",
           "a JSON list of {\"source\", \"context\"} (tests/tokenizers/chat_oracle.py writes one): "
           "time\n"
           "rendering each with r3's chat-template renderer, and encoding the result")
      .flag("add-special-tokens", false, "apply the post-processor's template (e.g. a BOS)")
      .flag("skip-special-tokens", false, "decode: leave special tokens out");
  if (!a.parse(argc, argv)) return 0;
  if (a.given("bench-chat")) {
    std::ifstream f(a.str("bench-chat"));
    if (!f) throw Error("tokenize: cannot read " + a.str("bench-chat"));
    const nlohmann::ordered_json cases = nlohmann::ordered_json::parse(f);
    std::map<std::string, std::unique_ptr<text::jinja::Template>> compiled;
    double parse_s = 0, render_s = 0, encode_s = 0;
    size_t rendered = 0, bytes = 0;
    const auto tok =
        a.str("tokenizer").empty() ? nullptr : text::Tokenizer::load(a.str("tokenizer"));
    for (const auto& c : cases) {
      const std::string src = c["source"];
      auto t0 = std::chrono::steady_clock::now();
      if (!compiled.count(src)) compiled[src] = std::make_unique<text::jinja::Template>(src);
      auto t1 = std::chrono::steady_clock::now();
      const text::jinja::Value ctx = text::jinja::from_json(c["context"]);
      std::string out;
      try {
        out = compiled[src]->render(*ctx.dict);
      } catch (const Error&) {
        continue;  // the template's raise_exception
      }
      auto t2 = std::chrono::steady_clock::now();
      if (tok) tok->encode(out, false);
      auto t3 = std::chrono::steady_clock::now();
      parse_s += std::chrono::duration<double>(t1 - t0).count();
      render_s += std::chrono::duration<double>(t2 - t1).count();
      encode_s += std::chrono::duration<double>(t3 - t2).count();
      ++rendered;
      bytes += out.size();
    }
    std::printf(
        "%s\n",
        json{
            {"templates", compiled.size()},
            {"renderings", rendered},
            {"rendered_bytes", bytes},
            {"parse_us_per_template", parse_s / double(std::max<size_t>(1, compiled.size())) * 1e6},
            {"render_us_per_conversation", render_s / double(std::max<size_t>(1, rendered)) * 1e6},
            {"encode_us_per_conversation",
             tok ? json(encode_s / double(std::max<size_t>(1, rendered)) * 1e6) : json(nullptr)}}
            .dump()
            .c_str());
    return 0;
  }
  if (a.str("tokenizer").empty()) throw Error("tokenize: --tokenizer DIR is required");
  const auto tok = text::Tokenizer::load(a.str("tokenizer"));
  if (a.given("decode")) {
    json ids;
    try {
      ids = json::parse(a.str("decode"));
    } catch (const json::exception& e) {
      throw Error(std::string("tokenize: --decode is not a JSON list of ids: ") + e.what());
    }
    if (!ids.is_array()) throw Error("tokenize: --decode is not a JSON list of ids");
    std::vector<int32_t> v;
    for (const json& id : ids) {
      if (!id.is_number_integer())
        throw Error("tokenize: --decode holds a non-integer id " + id.dump());
      v.push_back(id.get<int32_t>());
    }
    std::printf("%s\n", tok->decode(v, a.on("skip-special-tokens")).c_str());
    return 0;
  }
  if (a.given("bench")) {
    std::ifstream f(a.str("bench"));
    if (!f) throw Error("tokenize: cannot read " + a.str("bench"));
    const json corpus = json::parse(f);
    std::vector<std::string> texts = corpus.get<std::vector<std::string>>();
    size_t bytes = 0, tokens = 0;
    for (const std::string& s : texts) bytes += s.size();
    double best = 1e30;
    for (int64_t r = 0; r < std::max<int64_t>(1, a.integer("reps")); ++r) {
      tokens = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (const std::string& s : texts) tokens += tok->encode(s).size();
      best = std::min(best, seconds_since(t0));
    }
    std::printf("%s\n", json{{"strings", texts.size()},
                             {"bytes", bytes},
                             {"tokens", tokens},
                             {"seconds", best},
                             {"mb_per_s", double(bytes) / best / 1e6}}
                            .dump()
                            .c_str());
    return 0;
  }
  std::string text = a.str("text");
  if (!a.given("text"))
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  std::printf("%s\n", json(tok->encode(text, a.on("add-special-tokens"))).dump().c_str());
  return 0;
}

}  // namespace r3::cli
