#include "text/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdint>

#include "core/error.h"
#include "text/utf8.h"

namespace r3::text {

struct Regex::Impl {
  pcre2_code* code = nullptr;
  ~Impl() { pcre2_code_free(code); }
};

Regex::Regex(const std::string& pattern) : pattern_(pattern), impl_(std::make_unique<Impl>()) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw Error("regex \"" + pattern + "\" at offset " + std::to_string(offset) + ": " +
                reinterpret_cast<const char*>(msg));
  }
  pcre2_jit_compile(impl_->code,
                    PCRE2_JIT_COMPLETE);  // the interpreter runs when JIT is unavailable
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  if (!md) throw Error("regex: out of memory");
  // PCRE2's default match limit (10^7 steps) is a guard against catastrophic patterns, but the
  // tokenizers' own patterns backtrack once over a whitespace run (`\s*[\r\n]+` before
  // `\s+(?!\S)`): 10 MB of spaces, which Hugging Face encodes, exceeded it. The limit grows with
  // the text instead (64 steps a byte), so any text up to the body cap is encoded.
  pcre2_match_context* mc = pcre2_match_context_create(nullptr);
  if (!mc) {
    pcre2_match_data_free(md);
    throw Error("regex: out of memory");
  }
  pcre2_set_match_limit(
      mc, uint32_t(std::min<uint64_t>(UINT32_MAX, 10'000'000 + uint64_t(s.size()) * 64)));
  size_t at = 0;
  while (at <= s.size()) {
    const int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at,
                               PCRE2_NO_UTF_CHECK, md, mc);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(md);
      pcre2_match_context_free(mc);
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw Error("regex \"" + pattern_ + "\": " + reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      at = e;
    } else {
      if (b >= s.size()) break;
      const size_t n = utf8_sequence_length(s, b);
      at = b + (n ? n : 1);
    }
  }
  pcre2_match_data_free(md);
  pcre2_match_context_free(mc);
  return out;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  if (from.empty()) return std::string(s);
  std::string out;
  for (size_t i = 0;;) {
    const size_t j = s.find(from, i);
    if (j == std::string_view::npos) {
      out.append(s.substr(i));
      return out;
    }
    out.append(s.substr(i, j - i));
    out.append(to);
    i = j + from.size();
  }
}

}  // namespace r3::text
