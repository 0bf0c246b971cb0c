// tokenizer.json's "decoder": how token strings become text again (ByteLevel, ByteFallback,
// Fuse, Strip, Replace, Metaspace, Sequence). Works on a list of token strings, as Hugging Face's
// decode_chain does; the caller joins the result.
#pragma once
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "text/normalizer.h"

namespace r3::text {

class Decoder {
 public:
  // null, one decoder or a Sequence; an unknown type is an r3::Error naming it.
  static Decoder parse(const nlohmann::json& j);
  // Invalid UTF-8 that byte tokens produce comes out as U+FFFD (utf8_lossy; ByteFallback: one
  // per byte of an invalid run, as Hugging Face does). raw: the bytes as they are, invalid
  // sequences included (for streams, which must not decide a character before its last byte).
  std::vector<std::string> decode(std::vector<std::string> tokens, bool raw = false) const;
  bool empty() const { return steps_.empty(); }

 private:
  struct Step {
    enum Kind { ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace } kind;
    Pattern pattern;
    std::string content;
    int start = 0, stop = 0;
    bool prepend = true;  // Metaspace: a leading replacement on the first token was prepended
  };
  static Step parse_step(const nlohmann::json& j);
  std::vector<Step> steps_;
};

}  // namespace r3::text
