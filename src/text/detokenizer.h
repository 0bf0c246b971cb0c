// Incremental detokenisation for streams: text grows token by token, never ends inside a UTF-8
// character, and its growth concatenates to the whole text. Each new token decodes a short
// window of the tokens before it (as vLLM does), so a step costs the same at token 10 and at
// token 10,000; the window's bytes are kept raw and turned into text only up to the last
// character no later byte can change (utf8_stable_prefix), so a character split across tokens
// is decided once, with all its bytes.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace r3::text {

class Tokenizer;

class IncrementalDetokenizer {
 public:
  // context: the prompt's last tokens, decoded only so the first generated token is decoded in
  // context (decoders strip a leading space from the first token of a decode).
  IncrementalDetokenizer(const Tokenizer& tok, std::span<const int> context,
                         bool skip_special_tokens);
  // Appends a generated token; returns how many bytes text() grew by (0 while the bytes end in
  // the middle of a character).
  size_t push(int token);
  // No more tokens: an incomplete character left at the end comes out as U+FFFD.
  size_t finish();
  const std::string& text() const { return text_; }

 private:
  std::string decode(size_t begin, size_t end) const;
  size_t emit(size_t upto);  // text_ += the bytes raw_[emitted_, upto), repaired
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> tokens_;  // context + generated
  size_t prefix_ = 0,
         read_ = 0;     // tokens_[read_..] are not in raw_ yet; [prefix_, read_) is the window
  std::string raw_;     // the generated tokens' bytes
  size_t emitted_ = 0;  // raw_[0, emitted_) is in text_
  std::string text_;
};

}  // namespace r3::text
