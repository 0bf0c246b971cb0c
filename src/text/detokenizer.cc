#include "text/detokenizer.h"

#include <algorithm>

#include "text/tokenizer.h"
#include "text/utf8.h"

namespace r3::text {

namespace {
constexpr size_t kContextTokens = 5;
}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tok, std::span<const int> context,
                                               bool skip_special_tokens)
    : tok_(tok), skip_special_(skip_special_tokens) {
  const size_t n = std::min(context.size(), kContextTokens);
  for (size_t i = context.size() - n; i < context.size(); ++i)
    tokens_.push_back(int32_t(context[i]));
  prefix_ = 0;
  read_ = tokens_.size();
}

std::string IncrementalDetokenizer::decode(size_t begin, size_t end) const {
  return tok_.decode_raw(std::span<const int32_t>(tokens_.data() + begin, end - begin),
                         skip_special_);
}

size_t IncrementalDetokenizer::emit(size_t upto) {
  if (upto <= emitted_) return 0;
  const size_t before = text_.size();
  text_ += utf8_lossy(std::string_view(raw_).substr(emitted_, upto - emitted_));
  emitted_ = upto;
  return text_.size() - before;
}

size_t IncrementalDetokenizer::push(int token) {
  tokens_.push_back(int32_t(token));
  const std::string before = decode(prefix_, read_);
  const std::string now = decode(prefix_, tokens_.size());
  // The window's decode extends the previous one for every decoder r3 reads; were it not to,
  // the token waits and the next one decodes a wider window.
  if (now.compare(0, before.size(), before) != 0) return 0;
  raw_.append(now, before.size());
  prefix_ = read_;
  read_ = tokens_.size();
  return emit(utf8_stable_prefix(raw_));
}

size_t IncrementalDetokenizer::finish() {
  if (read_ < tokens_.size()) {  // tokens a window never took: the best the decoder gives
    const std::string before = decode(prefix_, read_), now = decode(prefix_, tokens_.size());
    raw_ += now.compare(0, before.size(), before) == 0 ? now.substr(before.size())
                                                       : decode(read_, tokens_.size());
    prefix_ = read_ = tokens_.size();
  }
  return emit(raw_.size());
}

}  // namespace r3::text
