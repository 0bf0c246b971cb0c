// The chat-template lexer: a template's source into segments (text, {{ }} and {% %} tags, with
// Hugging Face's whitespace rules), and a tag's body into tokens (text/jinja_syntax.h).
#include <cstring>
#include <string>
#include <vector>

#include "text/jinja_budget.h"
#include "text/jinja_syntax.h"
#include "text/utf8.h"

namespace r3::text::jinja {

// ---- segments: text and tags, with Hugging Face's whitespace rules applied ----

std::vector<Segment> segments(const std::string& src) {
  struct Raw {
    Segment seg;
    bool strip_before = false, strip_after = false, lstrip = false, trim = false;
  };
  std::vector<Raw> raw;
  // Line numbers counted as the scan moves forward (positions only grow), and each opener found
  // by one scan: the whole template is read a bounded number of times, whatever its size.
  size_t counted_to = 0;
  int counted_line = 1;
  auto line_of = [&](size_t at) {
    counted_line += int(std::count(src.begin() + long(counted_to), src.begin() + long(at), '\n'));
    counted_to = at;
    return counted_line;
  };
  auto next_opener = [&](size_t from) {
    for (size_t at = src.find('{', from); at != std::string::npos; at = src.find('{', at + 1))
      if (at + 1 < src.size() && (src[at + 1] == '{' || src[at + 1] == '%' || src[at + 1] == '#'))
        return at;
    return std::string::npos;
  };
  size_t pos = 0;
  while (pos < src.size()) {
    const size_t open = next_opener(pos);
    if (open == std::string::npos) {
      raw.push_back({{Segment::Text, src.substr(pos), line_of(pos)}});
      break;
    }
    if (open > pos) raw.push_back({{Segment::Text, src.substr(pos, open - pos), line_of(pos)}});
    const char kind = src[open + 1];
    const int line = line_of(open);
    size_t i = open + 2;
    Raw r;
    if (i < src.size() && src[i] == '-')
      r.strip_before = true, ++i;
    else if (i < src.size() && src[i] == '+')
      ++i;
    else
      r.lstrip = kind != '{';  // lstrip_blocks: block and comment tags
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    size_t end;
    if (kind == '#') {
      end = src.find(close, i);
      if (end == std::string::npos) fail(line, "unclosed comment");
    } else {
      // The closer outside string literals.
      char quote = 0;
      for (end = i; end < src.size(); ++end) {
        const char c = src[end];
        if (quote) {
          if (c == '\\')
            ++end;
          else if (c == quote)
            quote = 0;
        } else if (c == '\'' || c == '"') {
          quote = c;
        } else if (src.compare(end, 2, close) == 0) {
          break;
        }
      }
      if (end >= src.size()) fail(line, "unclosed " + std::string(kind == '{' ? "{{" : "{%"));
    }
    size_t body_end = end;
    if (body_end > i && src[body_end - 1] == '-')
      r.strip_after = true, --body_end;
    else if (body_end > i && src[body_end - 1] == '+')
      --body_end;
    else
      r.trim = kind != '{';  // trim_blocks
    r.seg = {kind == '{' ? Segment::Expr : Segment::Stmt, src.substr(i, body_end - i), line};
    // A comment renders nothing; it stays as a marked empty text (line -1) so its whitespace
    // rules still apply to its neighbours.
    if (kind == '#') r.seg = {Segment::Text, "", -1};
    raw.push_back(r);
    pos = end + 2;
  }
  // Whitespace control on the neighbouring text.
  for (size_t k = 0; k < raw.size(); ++k) {
    Raw& r = raw[k];
    const bool tag = r.seg.kind != Segment::Text || r.seg.line == -1;
    if (!tag) continue;
    if (k > 0 && raw[k - 1].seg.kind == Segment::Text && raw[k - 1].seg.line != -1) {
      std::string& t = raw[k - 1].seg.body;
      if (r.strip_before) {
        while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
      } else if (r.lstrip) {
        // Only when the tag starts its line: the text before it on the line is blank.
        size_t e = t.size();
        while (e > 0 && (t[e - 1] == ' ' || t[e - 1] == '\t')) --e;
        if (e == 0 ? k - 1 == 0 : t[e - 1] == '\n') t.resize(e);
      }
    }
    if (k + 1 < raw.size() && raw[k + 1].seg.kind == Segment::Text && raw[k + 1].seg.line != -1) {
      std::string& t = raw[k + 1].seg.body;
      if (r.strip_after) {
        size_t b = 0;
        while (b < t.size() && std::isspace(static_cast<unsigned char>(t[b]))) ++b;
        t.erase(0, b);
      } else if (r.trim) {
        if (t.compare(0, 1, "\n") == 0)
          t.erase(0, 1);
        else if (t.compare(0, 2, "\r\n") == 0)
          t.erase(0, 2);
      }
    }
  }
  std::vector<Segment> out;
  for (Raw& r : raw)
    if (!(r.seg.kind == Segment::Text && (r.seg.line == -1 || r.seg.body.empty())))
      out.push_back(std::move(r.seg));
  return out;
}

// ---- tokens inside a tag ----

std::vector<Tok> tokenize(const std::string& s, int line) {
  std::vector<Tok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Tok::Name, s.substr(i, j - i)});
      i = j;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool flt = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        flt = true;
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
        size_t k = j + 1;
        if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
        if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
          flt = true;
          j = k;
          while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
        }
      }
      std::string num = s.substr(i, j - i);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      out.push_back({flt ? Tok::Float : Tok::Int, num});
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          v += s[j];
          continue;
        }
        const char e = s[++j];
        switch (e) {
          case 'n':
            v += '\n';
            break;
          case 't':
            v += '\t';
            break;
          case 'r':
            v += '\r';
            break;
          case '\\':
            v += '\\';
            break;
          case '\'':
            v += '\'';
            break;
          case '"':
            v += '"';
            break;
          case '0':
            v += '\0';
            break;
          case 'u': {
            if (j + 4 >= s.size() ||
                !std::all_of(s.begin() + long(j) + 1, s.begin() + long(j) + 5,
                             [](char h) { return std::isxdigit(static_cast<unsigned char>(h)); }))
              fail(line, "bad \\u escape (\\u takes four hex digits)");
            v += utf8_encode(char32_t(std::strtoul(s.substr(j + 1, 4).c_str(), nullptr, 16)));
            j += 4;
            break;
          }
          default:
            v += '\\', v += e;  // Python keeps unknown escapes as written
        }
      }
      if (j >= s.size()) fail(line, "unterminated string");
      out.push_back({Tok::Str, v});
      i = j + 1;
      continue;
    }
    static const char* kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                 "/",  "%",  "~",  "|",  ".",  ",",  ":", "(", ")",
                                 "[",  "]",  "{",  "}",  "<",  ">",  "="};
    bool found = false;
    for (const char* op : kOps)
      if (s.compare(i, std::strlen(op), op) == 0) {
        out.push_back({Tok::Op, op});
        i += std::strlen(op);
        found = true;
        break;
      }
    if (!found) fail(line, std::string("unexpected character '") + c + "'");
  }
  out.push_back({Tok::End, ""});
  return out;
}

}  // namespace r3::text::jinja
