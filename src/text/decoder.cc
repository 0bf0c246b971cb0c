#include "text/decoder.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/pre_tokenizer.h"
#include "text/utf8.h"

namespace r3::text {

using json = nlohmann::json;

Decoder::Step Decoder::parse_step(const json& j) {
  const std::string type = j["type"];
  Step s{};
  if (type == "ByteLevel")
    s.kind = Step::ByteLevel;
  else if (type == "ByteFallback")
    s.kind = Step::ByteFallback;
  else if (type == "Fuse")
    s.kind = Step::Fuse;
  else if (type == "Strip") {
    s.kind = Step::Strip;
    s.content = j.value("content", " ");
    s.start = j.value("start", 0);
    s.stop = j.value("stop", 0);
  } else if (type == "Replace") {
    s.kind = Step::Replace;
    s.pattern = Pattern::parse(j.value("pattern", json()), "tokenizer.json: Replace decoder");
    s.content = j.value("content", "");
  } else if (type == "Metaspace") {
    s.kind = Step::Metaspace;
    s.content = j.value("replacement", "\xE2\x96\x81");
    if (j.contains("prepend_scheme"))
      s.prepend = j["prepend_scheme"] != "never";
    else
      s.prepend = j.value("add_prefix_space", true);
  } else
    throw Error("tokenizer.json: decoder \"" + type +
                "\" is not supported by r3 (supported: ByteLevel, ByteFallback, "
                "Fuse, Strip, Replace, Metaspace, Sequence)");
  return s;
}

Decoder Decoder::parse(const json& j) {
  Decoder d;
  for (const json& step : component_steps(j, "decoder", "decoders"))
    d.steps_.push_back(parse_step(step));
  return d;
}

namespace {
// "<0xAB>" -> 0xAB, or -1.
int byte_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  int v = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = t[size_t(i)];
    v = v * 16 + (c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1000);
  }
  return v < 0 ? -1 : v;
}
}  // namespace

std::vector<std::string> Decoder::decode(std::vector<std::string> tokens, bool raw) const {
  for (const Step& st : steps_) {
    std::vector<std::string> out;
    switch (st.kind) {
      case Step::ByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) {
          // A token whose characters are all byte-level ones becomes those bytes; any other
          // (an added token's text) passes through as it is.
          std::string mine;
          bool all = true;
          for (size_t i = 0; i < t.size() && all;) {
            size_t n;
            const int b = byte_level_byte(utf8_decode_one(t, i, &n));
            if (b < 0)
              all = false;
            else
              mine += char(b);
            i += n;
          }
          bytes += all ? mine : t;
        }
        out.push_back(raw ? std::move(bytes) : utf8_lossy(bytes));
        break;
      }
      case Step::ByteFallback: {
        std::string pending;
        auto flush = [&] {
          if (pending.empty()) return;
          if (raw || is_valid_utf8(pending))
            out.push_back(pending);
          else
            for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
          pending.clear();
        };
        for (std::string& t : tokens) {
          const int b = byte_token(t);
          if (b >= 0)
            pending += char(b);
          else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        break;
      }
      case Step::Fuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        out.push_back(std::move(all));
        break;
      }
      case Step::Strip:
        for (std::string& t : tokens) {
          size_t b = 0, e = t.size();
          for (int k = 0; k < st.start && b < e && t.compare(b, st.content.size(), st.content) == 0;
               ++k)
            b += st.content.size();
          for (int k = 0; k < st.stop && e >= b + st.content.size() &&
                          t.compare(e - st.content.size(), st.content.size(), st.content) == 0;
               ++k)
            e -= st.content.size();
          out.push_back(t.substr(b, e - b));
        }
        break;
      case Step::Replace:
        for (const std::string& t : tokens) out.push_back(st.pattern.replace_all(t, st.content));
        break;
      case Step::Metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::string t = replace_all(tokens[i], st.content, " ");
          if (i == 0 && st.prepend && !t.empty() && t[0] == ' ') t.erase(0, 1);
          out.push_back(std::move(t));
        }
        break;
    }
    tokens = std::move(out);
  }
  return tokens;
}

}  // namespace r3::text
