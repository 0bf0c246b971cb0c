// tokenizer.json's "model" of type BPE: the vocabulary, merges by rank, and the encoding of
// one pre-tokenised word (ignore_merges, byte_fallback, unk_token, subword prefix and suffix).
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace r3::text {

class Bpe {
 public:
  // Every inconsistency (a merge whose parts or result are not in the vocabulary, dropout,
  // another model type) is an r3::Error naming it.
  static Bpe parse(const nlohmann::json& model);
  // Appends the ids of one word.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  std::optional<int32_t> id(std::string_view token) const;
  // The token of an id, or nullptr for an id the vocabulary lacks.
  const std::string* token(int32_t id) const;
  int32_t vocab_end() const { return int32_t(tokens_.size()); }  // one past the largest id

 private:
  struct Merge {
    int32_t rank, result;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (uint64_t(uint32_t(a)) << 32) | uint32_t(b);
  }
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_;
  std::vector<bool> has_token_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  std::string prefix_, suffix_;  // continuing_subword_prefix, end_of_word_suffix
};

}  // namespace r3::text
