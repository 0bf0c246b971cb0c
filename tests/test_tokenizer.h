// A small byte-level BPE tokenizer in the layout of the released ones (GPT-2 byte alphabet,
// Qwen's split regex, a few merges, chat special tokens, a Qwen-style chat template), written by
// the tests themselves so the text tests need nothing downloaded.
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include <unistd.h>

#include "model/make_model.h"
#include "text/pre_tokenizer.h"

namespace r3::testing {

inline const char* kTestChatTemplate =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

// Writes tokenizer.json and tokenizer_config.json into dir; returns dir.
inline std::string write_test_tokenizer(const std::string& dir) {
  using json = nlohmann::json;
  std::filesystem::create_directories(dir);
  json vocab = json::object();
  const auto& chars = text::byte_level_chars();
  for (int b = 0; b < 256; ++b) vocab[chars[size_t(b)]] = b;
  const std::string G = chars[' '];  // "Ġ"
  const std::vector<std::pair<std::string, std::string>> merges = {
      {G, "t"},   {"h", "e"},  {G + "t", "he"}, {"i", "n"}, {G, "a"},   {"e", "r"},
      {"o", "n"}, {G, "s"},    {"r", "e"},      {"l", "l"}, {"o", "r"}, {G, "w"},
      {"a", "n"}, {"an", "d"}, {G, "and"},      {"in", "g"}};
  json jm = json::array();
  int next = 256;
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    jm.push_back({a, b});
  }
  json added = json::array();
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"})
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
  json tj = {{"version", "1.0"},
             {"truncation", nullptr},
             {"padding", nullptr},
             {"added_tokens", added},
             {"normalizer", {{"type", "NFC"}}},
             {"pre_tokenizer",
              {{"type", "Sequence"},
               {"pretokenizers",
                {{{"type", "Split"},
                  {"pattern",
                   {{"Regex",
                     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
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
               {"merges", jm}}}};
  std::ofstream(std::filesystem::path(dir) / "tokenizer.json") << tj.dump();
  json cfg = {{"bos_token", nullptr},
              {"eos_token", "<|im_end|>"},
              {"pad_token", "<|endoftext|>"},
              {"clean_up_tokenization_spaces", false},
              {"chat_template", kTestChatTemplate}};
  std::ofstream(std::filesystem::path(dir) / "tokenizer_config.json") << cfg.dump();
  return dir;
}

// A tiny qwen3_moe checkpoint carrying the test tokenizer (make-model --tokenizer), made once.
inline std::string model_with_tokenizer() {
  static std::string dir;
  if (!dir.empty()) return dir;
  const std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("r3_text_" + std::to_string(getpid()));
  MakeModelOptions o;
  o.arch = "qwen3_moe";
  o.out = (root / "model").string();
  o.tokenizer = write_test_tokenizer((root / "tokenizer").string());
  make_model(o);
  return dir = o.out;
}

}  // namespace r3::testing
