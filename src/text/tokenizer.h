// A Hugging Face tokenizer: tokenizer.json (normalizer, pre-tokenizer, BPE model, decoder,
// post-processor, added tokens) and tokenizer_config.json (special tokens, chat template).
// Every feature of the file r3 does not implement is an r3::Error naming it when the file is
// loaded, never a silent difference. Thread-safe once loaded (encode and decode are const).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/bpe.h"
#include "text/decoder.h"
#include "text/jinja.h"
#include "text/normalizer.h"
#include "text/pre_tokenizer.h"

namespace r3::text {

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, lstrip, rstrip, normalized, single_word;
};

class Tokenizer {
 public:
  // dir holds tokenizer.json and, optionally, tokenizer_config.json and chat_template.jinja (which,
  // as in transformers, replaces tokenizer_config.json's chat_template).
  static std::shared_ptr<Tokenizer> load(const std::string& dir);
  // The same from the files' text; `where` names them in errors.
  static std::shared_ptr<Tokenizer> from_json(const std::string& tokenizer_json,
                                              const std::string& config_json,
                                              const std::string& where);
  // Whether dir has a tokenizer r3 can load (tokenizer.json).
  static bool present(const std::string& dir);

  // text must be valid UTF-8 (an r3::Error otherwise). Added tokens in the text are matched as
  // such; add_special_tokens applies the post-processor's template (e.g. a BOS).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Ids the tokenizer has no token for (the padding of a model's vocabulary) decode to nothing,
  // as in Hugging Face's decode. Invalid UTF-8 from byte tokens is U+FFFD.
  // clean_up: nullopt follows tokenizer_config's clean_up_tokenization_spaces.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false,
                     std::optional<bool> clean_up = std::nullopt) const;

  // What the decoder makes of ids before any UTF-8 repair: bytes, possibly invalid (streams cut
  // them at character boundaries themselves). No clean-up.
  std::string decode_raw(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  int32_t vocab_size() const { return vocab_end_; }  // one past the largest id
  // The most bytes any one token decodes to (computed once): a text of B bytes needs at least
  // B / (4 * this) tokens, whatever the normalizer does (none shrinks text by 4x), so a prompt
  // too long for the context can be refused before it is encoded.
  size_t max_token_bytes() const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }

  // bos_token, eos_token, unk_token, pad_token of tokenizer_config.json (those it sets), as a
  // chat template sees them.
  const std::vector<std::pair<std::string, std::string>>& special_tokens() const {
    return special_tokens_;
  }
  const std::string& bos_token() const { return bos_token_; }  // empty when none
  const std::string& eos_token() const { return eos_token_; }
  std::optional<int32_t> bos_id() const {
    return bos_token_.empty() ? std::nullopt : token_to_id(bos_token_);
  }
  std::optional<int32_t> eos_id() const {
    return eos_token_.empty() ? std::nullopt : token_to_id(eos_token_);
  }
  // The default chat template (tokenizer_config's chat_template), empty when none.
  const std::string& chat_template() const { return chat_template_; }
  // A named template of a list-form chat_template (e.g. "tool_use"), or nullptr.
  const std::string* named_chat_template(const std::string& name) const;
  // chat_template() parsed, once: every chat request renders it. r3::Error when there is none
  // or it is outside r3's Jinja subset (thrown again on every call).
  std::shared_ptr<const jinja::Template> parsed_chat_template() const;

 private:
  struct Section {
    std::string_view text;
    int32_t added = -1;  // the added token this section is, or -1 for text
  };
  // Cuts `text` at the added tokens matched on it (those with the given `normalized` flag).
  std::vector<Section> split_added(std::string_view text, bool normalized) const;
  std::string decode_tokens(std::span<const int32_t> ids, bool skip_special_tokens, bool raw) const;
  void encode_text(std::string_view text, bool first, std::vector<int32_t>& out) const;

  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  Bpe model_;
  Decoder decoder_;
  std::vector<AddedToken> added_;
  std::vector<int32_t> added_by_id_;                      // index into added_, or -1; by id
  std::vector<std::vector<size_t>> added_by_first_byte_;  // [256] indices, longest first
  // The post-processor's single-sequence template: ids before and after the text.
  std::vector<int32_t> template_prefix_, template_suffix_;
  int32_t vocab_end_ = 0;
  std::string bos_token_, eos_token_, chat_template_;
  std::vector<std::pair<std::string, std::string>> named_templates_;
  std::vector<std::pair<std::string, std::string>> special_tokens_;
  bool clean_up_spaces_ = false;
  mutable std::mutex parsed_mu_;
  mutable size_t max_token_bytes_ = 0;  // under parsed_mu_
  mutable std::shared_ptr<const jinja::Template> parsed_;
};

// Hugging Face's clean_up_tokenization_spaces: " ." -> "." and the like.
std::string clean_up_tokenization(std::string s);

}  // namespace r3::text
