// tokenizer.json's "pre_tokenizer": how normalised text is cut into the words BPE sees (Split
// on the release's Unicode regex, ByteLevel, Digits, Metaspace, WhitespaceSplit, Sequence).
#pragma once
#include <array>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "text/normalizer.h"

namespace r3::text {

// GPT-2's byte-to-character table: every byte as a printable character (ByteLevel).
const std::array<std::string, 256>& byte_level_chars();
// The byte a ByteLevel character stands for, or -1.
int byte_level_byte(char32_t c);

class PreTokenizer {
 public:
  // null, one pre-tokenizer or a Sequence; an unknown type or option is an r3::Error naming it.
  static PreTokenizer parse(const nlohmann::json& j);
  // The words of one section of text (the text between added tokens); `first` marks the section
  // at the start of the input (Metaspace's prepend_scheme "first").
  std::vector<std::string> split(std::string section, bool first) const;

 private:
  enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
  struct Step {
    enum Kind { Split, ByteLevel, Digits, Metaspace, WhitespaceSplit } kind;
    Pattern pattern;
    Behavior behavior = Behavior::Isolated;
    bool invert = false;
    bool add_prefix_space = false, use_regex = false;
    bool individual_digits = false;
    std::string replacement;
    std::string prepend_scheme;
    bool split_words = true;
  };
  static Step parse_step(const nlohmann::json& j);
  static void split_by(const std::string& s, const std::vector<std::pair<size_t, size_t>>& matches,
                       Behavior b, bool invert, std::vector<std::string>& out);
  std::vector<Step> steps_;
};

}  // namespace r3::text
