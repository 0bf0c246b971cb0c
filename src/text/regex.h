// A Unicode-property regular expression (PCRE2, UTF and UCP mode, JIT-compiled where the
// platform allows): the Split pre-tokenizers and Replace normalizers of tokenizer.json.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace r3::text {

class Regex {
 public:
  // Throws r3::Error quoting the pattern and PCRE2's message for a pattern it cannot compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;
  // Non-overlapping matches, left to right, as [begin, end) byte offsets; `s` must be valid UTF-8.
  // An empty match advances by one character.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Impl;
  std::string pattern_;
  std::unique_ptr<Impl> impl_;
};

// `s` with every match of a literal string replaced.
std::string replace_all(std::string_view s, std::string_view from, std::string_view to);

}  // namespace r3::text
