// tokenizer.json's "normalizer": what the text goes through before pre-tokenisation (Unicode
// normal forms, lowercase, literal or regex replacement, prepend, strip), as a list of steps.
#pragma once
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "text/regex.h"

namespace r3::text {

class Normalizer {
 public:
  // null, one normalizer or a Sequence; an unknown type is an r3::Error naming it.
  static Normalizer parse(const nlohmann::json& j);
  std::string apply(std::string_view s) const;
  bool empty() const { return steps_.empty(); }

 private:
  struct Step {
    enum Kind { NFC, NFD, NFKC, NFKD, Lowercase, ReplaceString, ReplaceRegex, Prepend, Strip } kind;
    std::string pattern, content;
    std::shared_ptr<Regex> regex;
    bool left = false, right = false;
  };
  static Step parse_step(const nlohmann::json& j);
  std::vector<Step> steps_;
};

// The steps of one tokenizer.json component (`what`: "normalizer", "pre_tokenizer", ...): none
// for null, the items of a Sequence (under `list_key`, nested Sequences flattened), or the one
// object; each has a string "type" (r3::Error naming the component otherwise).
std::vector<nlohmann::json> component_steps(const nlohmann::json& j, const char* what,
                                            const char* list_key);

// A Replace pattern ({"String": s} or {"Regex": r}): the literal string, or the compiled regex.
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;
  static Pattern parse(const nlohmann::json& j, const char* where);
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;
  std::string replace_all(std::string_view s, std::string_view with) const;
};

}  // namespace r3::text
