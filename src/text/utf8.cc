#include "text/utf8.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "core/error.h"

namespace r3::text {

size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const size_t n = s.size() - i;
  const unsigned c = b(i);
  if (c < 0x80) return 1;
  if (c < 0xC2) return 0;
  auto cont = [&](size_t k, unsigned lo, unsigned hi) {
    return k < s.size() && b(k) >= lo && b(k) <= hi;
  };
  if (c < 0xE0) return n >= 2 && cont(i + 1, 0x80, 0xBF) ? 2 : 0;
  if (c < 0xF0) {
    const unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    return cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) ? 3 : 0;
  }
  if (c < 0xF5) {
    const unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    return cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) && cont(i + 3, 0x80, 0xBF) ? 4 : 0;
  }
  return 0;
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

namespace {
// Bytes of the longest prefix of a valid sequence starting at s[i] (at least 1): the maximal
// subpart that one U+FFFD replaces.
size_t maximal_subpart(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c = b(i);
  size_t need;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c < 0xE0)
    need = 1;
  else if (c >= 0xE0 && c < 0xF0) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c < 0xF5) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else
    return 1;
  size_t k = 1;
  for (; k <= need && i + k < s.size(); ++k) {
    const unsigned x = b(i + k);
    if (x < (k == 1 ? lo : 0x80) || x > (k == 1 ? hi : 0xBF)) break;
  }
  return k;
}
}  // namespace

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const size_t n = utf8_sequence_length(bytes, i);
    if (n) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += maximal_subpart(bytes, i);
    }
  }
  return out;
}

size_t utf8_stable_prefix(std::string_view bytes) {
  // Only the last three bytes can be the start of a character that more bytes would complete.
  const size_t from = bytes.size() > 3 ? bytes.size() - 3 : 0;
  for (size_t i = from; i < bytes.size(); ++i) {
    const unsigned c = static_cast<unsigned char>(bytes[i]);
    if (c < 0xC2 || c >= 0xF5) continue;
    if (utf8_sequence_length(bytes, i)) continue;
    if (maximal_subpart(bytes, i) == bytes.size() - i) return i;  // a valid start, cut short
  }
  return bytes.size();
}

std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_sequence_length(s, i);
    if (n == 0) n = 1;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

std::string utf8_encode(char32_t c) {
  std::string out;
  if (c < 0x80)
    out += char(c);
  else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
  return out;
}

char32_t utf8_decode_one(std::string_view s, size_t i, size_t* len) {
  size_t n = utf8_sequence_length(s, i);
  if (n == 0) {
    *len = 1;
    return 0xFFFD;
  }
  *len = n;
  const auto b = [&](size_t k) { return char32_t(static_cast<unsigned char>(s[k])); };
  if (n == 1) return b(i);
  if (n == 2) return ((b(i) & 0x1F) << 6) | (b(i + 1) & 0x3F);
  if (n == 3) return ((b(i) & 0x0F) << 12) | ((b(i + 1) & 0x3F) << 6) | (b(i + 2) & 0x3F);
  return ((b(i) & 0x07) << 18) | ((b(i + 1) & 0x3F) << 12) | ((b(i + 2) & 0x3F) << 6) |
         (b(i + 3) & 0x3F);
}

bool is_unicode_space(char32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0D) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool is_word_char(char32_t c) {
  if (c == '_') return true;
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

namespace {
std::string utf8proc_apply(std::string_view s, int options, const char* what) {
  if (s.empty()) return {};
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()),
                   &out, utf8proc_option_t(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  if (n < 0) throw Error(std::string(what) + ": " + utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(out), size_t(n));
}
}  // namespace

std::string unicode_normalize(std::string_view s, NormalForm form) {
  int opt = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::NFC:
      opt |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::NFD:
      opt |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::NFKC:
      opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::NFKD:
      opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  return utf8proc_apply(s, opt, "unicode normalisation");
}

std::string unicode_lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t n;
    const char32_t c = utf8_decode_one(s, i, &n);
    out += utf8_encode(char32_t(utf8proc_tolower(utf8proc_int32_t(c))));
    i += n;
  }
  return out;
}

}  // namespace r3::text
