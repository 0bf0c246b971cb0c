#include "text/normalizer.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/utf8.h"

namespace r3::text {

using json = nlohmann::json;

Pattern Pattern::parse(const json& j, const char* where) {
  Pattern p;
  if (j.is_object() && j.contains("String") && j["String"].is_string())
    p.literal = j["String"];
  else if (j.is_object() && j.contains("Regex") && j["Regex"].is_string())
    p.regex = std::make_shared<Regex>(j["Regex"]);
  else
    throw Error(std::string(where) + ": pattern must be {\"String\": ...} or {\"Regex\": ...}");
  return p;
}

std::vector<std::pair<size_t, size_t>> Pattern::find_all(std::string_view s) const {
  if (regex) return regex->find_all(s);
  std::vector<std::pair<size_t, size_t>> out;
  if (literal.empty()) return out;
  for (size_t i = s.find(literal); i != std::string_view::npos;
       i = s.find(literal, i + literal.size()))
    out.emplace_back(i, i + literal.size());
  return out;
}

std::string Pattern::replace_all(std::string_view s, std::string_view with) const {
  std::string out;
  size_t at = 0;
  for (auto [b, e] : find_all(s)) {
    out.append(s.substr(at, b - at));
    out.append(with);
    at = e;
  }
  out.append(s.substr(at));
  return out;
}

std::vector<json> component_steps(const json& j, const char* what, const char* list_key) {
  std::vector<json> out;
  if (j.is_null()) return out;
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    throw Error(std::string("tokenizer.json: ") + what + " without a \"type\"");
  if (j["type"] != "Sequence") {
    out.push_back(j);
    return out;
  }
  const json items = j.value(list_key, json::array());
  if (!items.is_array())
    throw Error(std::string("tokenizer.json: ") + what + " Sequence without a \"" + list_key +
                "\" list");
  for (const json& item : items)
    for (json& step : component_steps(item, what, list_key)) out.push_back(std::move(step));
  return out;
}

Normalizer::Step Normalizer::parse_step(const json& j) {
  const std::string type = j["type"];
  Step s{};
  if (type == "NFC")
    s.kind = Step::NFC;
  else if (type == "NFD")
    s.kind = Step::NFD;
  else if (type == "NFKC")
    s.kind = Step::NFKC;
  else if (type == "NFKD")
    s.kind = Step::NFKD;
  else if (type == "Lowercase")
    s.kind = Step::Lowercase;
  else if (type == "Replace") {
    Pattern p = Pattern::parse(j.value("pattern", json()), "tokenizer.json: Replace normalizer");
    s.kind = p.regex ? Step::ReplaceRegex : Step::ReplaceString;
    s.pattern = p.literal;
    s.regex = p.regex;
    s.content = j.value("content", "");
  } else if (type == "Prepend") {
    s.kind = Step::Prepend;
    s.content = j.value("prepend", "");
  } else if (type == "Strip") {
    s.kind = Step::Strip;
    s.left = j.value("strip_left", false);
    s.right = j.value("strip_right", false);
  } else
    throw Error("tokenizer.json: normalizer \"" + type +
                "\" is not supported by r3 (supported: NFC, NFD, NFKC, NFKD, "
                "Lowercase, Replace, Prepend, Strip, Sequence)");
  return s;
}

Normalizer Normalizer::parse(const json& j) {
  Normalizer n;
  for (const json& step : component_steps(j, "normalizer", "normalizers"))
    n.steps_.push_back(parse_step(step));
  return n;
}

namespace {
std::string strip(std::string_view s, bool left, bool right) {
  size_t b = 0, e = s.size();
  while (left && b < e) {
    size_t n;
    if (!is_unicode_space(utf8_decode_one(s, b, &n))) break;
    b += n;
  }
  while (right && e > b) {
    size_t k = e - 1;
    while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    size_t n;
    if (!is_unicode_space(utf8_decode_one(s, k, &n))) break;
    e = k;
  }
  return std::string(s.substr(b, e - b));
}
}  // namespace

std::string Normalizer::apply(std::string_view in) const {
  std::string s(in);
  for (const Step& st : steps_) {
    switch (st.kind) {
      case Step::NFC:
        s = unicode_normalize(s, NormalForm::NFC);
        break;
      case Step::NFD:
        s = unicode_normalize(s, NormalForm::NFD);
        break;
      case Step::NFKC:
        s = unicode_normalize(s, NormalForm::NFKC);
        break;
      case Step::NFKD:
        s = unicode_normalize(s, NormalForm::NFKD);
        break;
      case Step::Lowercase:
        s = unicode_lowercase(s);
        break;
      case Step::ReplaceString:
        s = replace_all(s, st.pattern, st.content);
        break;
      case Step::ReplaceRegex:
        s = Pattern{{}, st.regex}.replace_all(s, st.content);
        break;
      case Step::Prepend:
        if (!s.empty()) s = st.content + s;
        break;
      case Step::Strip:
        s = strip(s, st.left, st.right);
        break;
    }
  }
  return s;
}

}  // namespace r3::text
