#include "text/pre_tokenizer.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/utf8.h"

namespace r3::text {

using json = nlohmann::json;

namespace {
// GPT-2's byte-level split, which ByteLevel applies itself when use_regex is true.
const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct ByteTables {
  std::array<std::string, 256> chars;
  std::array<int, 512> bytes;  // indexed by code point (all below 0x144)
  ByteTables() {
    bytes.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? char32_t(b) : char32_t(256 + n++);
      chars[size_t(b)] = utf8_encode(c);
      bytes[size_t(c)] = b;
    }
  }
};
const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}
}  // namespace

const std::array<std::string, 256>& byte_level_chars() { return byte_tables().chars; }
int byte_level_byte(char32_t c) { return c < 512 ? byte_tables().bytes[c] : -1; }

PreTokenizer::Step PreTokenizer::parse_step(const json& j) {
  const std::string type = j["type"];
  Step s{};
  if (type == "Split") {
    s.kind = Step::Split;
    s.pattern = Pattern::parse(j.value("pattern", json()), "tokenizer.json: Split pre_tokenizer");
    const std::string b = j.value("behavior", "Isolated");
    if (b == "Removed")
      s.behavior = Behavior::Removed;
    else if (b == "Isolated")
      s.behavior = Behavior::Isolated;
    else if (b == "MergedWithPrevious")
      s.behavior = Behavior::MergedWithPrevious;
    else if (b == "MergedWithNext")
      s.behavior = Behavior::MergedWithNext;
    else if (b == "Contiguous")
      s.behavior = Behavior::Contiguous;
    else
      throw Error("tokenizer.json: Split behavior \"" + b + "\" is not supported by r3");
    s.invert = j.value("invert", false);
  } else if (type == "ByteLevel") {
    s.kind = Step::ByteLevel;
    s.add_prefix_space = j.value("add_prefix_space", false);
    s.use_regex = j.value("use_regex", true);
    if (s.use_regex) s.pattern.regex = std::make_shared<Regex>(kGpt2Pattern);
  } else if (type == "Digits") {
    s.kind = Step::Digits;
    s.individual_digits = j.value("individual_digits", false);
    s.pattern.regex = std::make_shared<Regex>(s.individual_digits ? "\\p{Nd}" : "\\p{Nd}+");
  } else if (type == "Metaspace") {
    s.kind = Step::Metaspace;
    s.replacement = j.value("replacement", "\xE2\x96\x81");
    if (j.contains("prepend_scheme"))
      s.prepend_scheme = j["prepend_scheme"];
    else
      s.prepend_scheme = j.value("add_prefix_space", true) ? "always" : "never";
    if (s.prepend_scheme != "always" && s.prepend_scheme != "first" && s.prepend_scheme != "never")
      throw Error("tokenizer.json: Metaspace prepend_scheme \"" + s.prepend_scheme +
                  "\" is not supported by r3");
    s.split_words = j.value("split", true);
    s.pattern.literal = s.replacement;
  } else if (type == "WhitespaceSplit") {
    s.kind = Step::WhitespaceSplit;
    s.pattern.regex = std::make_shared<Regex>("\\s+");
  } else
    throw Error("tokenizer.json: pre_tokenizer \"" + type +
                "\" is not supported by r3 (supported: Split, ByteLevel, "
                "Digits, Metaspace, WhitespaceSplit, Sequence)");
  return s;
}

PreTokenizer PreTokenizer::parse(const json& j) {
  PreTokenizer p;
  for (const json& step : component_steps(j, "pre_tokenizer", "pretokenizers"))
    p.steps_.push_back(parse_step(step));
  return p;
}

// The pieces of `s` around `matches` (the delimiters, or with invert the content), as Hugging
// Face's SplitDelimiterBehavior defines them. Empty pieces are dropped.
void PreTokenizer::split_by(const std::string& s,
                            const std::vector<std::pair<size_t, size_t>>& matches, Behavior b,
                            bool invert, std::vector<std::string>& out) {
  struct Part {
    size_t begin, end;
    bool delim;
  };
  std::vector<Part> parts;
  size_t at = 0;
  for (auto [mb, me] : matches) {
    if (mb > at) parts.push_back({at, mb, invert});
    parts.push_back({mb, me, !invert});
    at = me;
  }
  if (at < s.size()) parts.push_back({at, s.size(), invert});
  std::vector<std::pair<size_t, size_t>> pieces;
  bool previous = false;  // the last part seen was a delimiter
  switch (b) {
    case Behavior::Isolated:
      for (const Part& p : parts) pieces.emplace_back(p.begin, p.end);
      break;
    case Behavior::Removed:
      for (const Part& p : parts)
        if (!p.delim) pieces.emplace_back(p.begin, p.end);
      break;
    case Behavior::MergedWithPrevious:
      for (const Part& p : parts) {
        if (p.delim && !previous && !pieces.empty())
          pieces.back().second = p.end;
        else
          pieces.emplace_back(p.begin, p.end);
        previous = p.delim;
      }
      break;
    case Behavior::MergedWithNext:  // the same, walking backwards
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->delim && !previous && !pieces.empty())
          pieces.back().first = it->begin;
        else
          pieces.emplace_back(it->begin, it->end);
        previous = it->delim;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    case Behavior::Contiguous:
      for (const Part& p : parts) {
        if (p.delim == previous && !pieces.empty())
          pieces.back().second = p.end;
        else
          pieces.emplace_back(p.begin, p.end);
        previous = p.delim;
      }
      break;
  }
  for (auto [pb, pe] : pieces)
    if (pe > pb) out.push_back(s.substr(pb, pe - pb));
}

std::vector<std::string> PreTokenizer::split(std::string section, bool first) const {
  std::vector<std::string> words;
  if (section.empty()) return words;
  words.push_back(std::move(section));
  for (const Step& st : steps_) {
    std::vector<std::string> next;
    next.reserve(words.size());
    for (size_t w = 0; w < words.size(); ++w) {
      std::string& word = words[w];
      switch (st.kind) {
        case Step::Split:
          split_by(word, st.pattern.find_all(word), st.behavior, st.invert, next);
          break;
        case Step::Digits:
          split_by(word, st.pattern.find_all(word),
                   st.individual_digits ? Behavior::Isolated : Behavior::Contiguous, false, next);
          break;
        case Step::WhitespaceSplit:
          split_by(word, st.pattern.find_all(word), Behavior::Removed, false, next);
          break;
        case Step::ByteLevel: {
          if (st.add_prefix_space && !word.empty() && word[0] != ' ')
            word.insert(word.begin(), ' ');
          std::vector<std::string> parts;
          if (st.use_regex)
            split_by(word, st.pattern.find_all(word), Behavior::Isolated, false, parts);
          else
            parts.push_back(std::move(word));
          const auto& chars = byte_level_chars();
          for (const std::string& p : parts) {
            std::string mapped;
            mapped.reserve(p.size() * 2);
            for (unsigned char c : p) mapped += chars[c];
            next.push_back(std::move(mapped));
          }
          break;
        }
        case Step::Metaspace: {
          std::string m = replace_all(word, " ", st.replacement);
          const bool prepend =
              st.prepend_scheme == "always" || (st.prepend_scheme == "first" && first && w == 0);
          if (prepend && m.compare(0, st.replacement.size(), st.replacement) != 0)
            m = st.replacement + m;
          if (st.split_words)
            split_by(m, st.pattern.find_all(m), Behavior::MergedWithNext, false, next);
          else
            next.push_back(std::move(m));
          break;
        }
      }
    }
    words = std::move(next);
  }
  return words;
}

}  // namespace r3::text
