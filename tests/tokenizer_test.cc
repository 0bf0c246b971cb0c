// The tokenizer's pieces on hand-made inputs: UTF-8 repair and stream prefixes, a Llama-2-style
// (SentencePiece BPE) tokenizer.json with byte fallback, unk fusing and a BOS template, added
// tokens with lstrip/rstrip/single_word, and every unsupported feature refused by name. The
// released tokenizers are checked against an independent encoder in tokenizer_oracle_test.cc.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/cancellation.h"
#include "core/error.h"
#include "text/regex.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace r3::text {
namespace {

using json = nlohmann::json;
const std::string kFffd = "\xEF\xBF\xBD";

// Issue 48: 10 MB of spaces made the Qwen3/GPT-2 split pattern exceed PCRE2's default match
// limit (an HTTP 400 for text Hugging Face encodes); the limit now grows with the text.
TEST(Regex, LongWhitespaceRunsMatchWhole) {
  const Regex split("\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+");
  for (size_t n : {size_t(1000), size_t(12'000'000)}) {
    const auto m = split.find_all(std::string(n, ' '));
    ASSERT_EQ(m.size(), 1u) << n;
    EXPECT_EQ(m[0], std::make_pair(size_t(0), n));
  }
}

TEST(Utf8, LossyDecodeReplacesEachMaximalSubpart) {
  EXPECT_EQ(utf8_lossy("ok"), "ok");
  EXPECT_EQ(utf8_lossy("a\xF0\x9F\x98"), "a" + kFffd);           // a cut 4-byte sequence: one
  EXPECT_EQ(utf8_lossy("\xC0\x80"), kFffd + kFffd);              // overlong: each byte
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);  // a surrogate: each byte
  EXPECT_EQ(utf8_lossy("\xE2\x82x"), kFffd + "x");               // cut 3-byte sequence, then text
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // above U+10FFFF
  EXPECT_EQ(utf8_lossy("\xE2\x82\xAC"), "\xE2\x82\xAC");
}

TEST(Utf8, StablePrefixHoldsBackOnlyACharacterMoreBytesCanComplete) {
  EXPECT_EQ(utf8_stable_prefix("ab\xF0\x9F"), 2u);
  EXPECT_EQ(utf8_stable_prefix("ab\xF0\x9F\x98\x80"), 6u);
  EXPECT_EQ(utf8_stable_prefix("ab\x80"), 3u);  // can never become valid: shown (as U+FFFD)
  EXPECT_EQ(utf8_stable_prefix("ab\xC3"), 2u);
  EXPECT_EQ(utf8_stable_prefix("ab\xC0"), 3u);  // never a valid lead byte
  EXPECT_EQ(utf8_stable_prefix(""), 0u);
}

// A Llama-2-style file: the normalizer turns spaces into "▁" and prepends one, BPE with byte
// fallback and fused unknowns, a decoder chain undoing it, a BOS template.
json llama2_style() {
  json vocab = {{"<unk>", 0},   {"<s>", 1},     {"</s>", 2},   {"\xE2\x96\x81", 3},
                {"h", 4},       {"e", 5},       {"l", 6},      {"o", 7},
                {"w", 8},       {"r", 9},       {"d", 10},     {"he", 11},
                {"ll", 12},     {"hell", 13},   {"hello", 14}, {"\xE2\x96\x81hello", 15},
                {"<0xC3>", 16}, {"<0xA9>", 17}, {"wo", 18}};
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"added_tokens",
       {{{"id", 0},
         {"content", "<unk>"},
         {"special", true},
         {"lstrip", false},
         {"rstrip", false},
         {"normalized", false},
         {"single_word", false}},
        {{"id", 1},
         {"content", "<s>"},
         {"special", true},
         {"lstrip", false},
         {"rstrip", false},
         {"normalized", false},
         {"single_word", false}},
        {{"id", 2},
         {"content", "</s>"},
         {"special", true},
         {"lstrip", false},
         {"rstrip", false},
         {"normalized", false},
         {"single_word", false}}}},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", {"h e", "l l", "he ll", "hell o", "\xE2\x96\x81 hello", "w o"}}}}};
}

std::shared_ptr<Tokenizer> make(const json& j, const std::string& config = "") {
  return Tokenizer::from_json(j.dump(), config, "<test>");
}

TEST(Tokenizer, SentencePieceStyleBpeWithByteFallbackAndTemplate) {
  auto t = make(llama2_style(), R"({"bos_token": "<s>", "eos_token": {"content": "</s>"}})");
  using V = std::vector<int32_t>;
  EXPECT_EQ(t->encode("hello world"), (V{15, 3, 18, 9, 6, 10}));
  EXPECT_EQ(t->encode("hello world", true), (V{1, 15, 3, 18, 9, 6, 10}));
  EXPECT_EQ(t->encode("\xC3\xA9"), (V{3, 16, 17}));  // é is not in the vocab: its bytes
  EXPECT_EQ(t->encode("zz"), (V{3, 0}));             // unknown characters fuse into one <unk>
  EXPECT_EQ(t->decode(V{1, 15, 3, 18, 9, 6, 10}, true), "hello world");
  EXPECT_EQ(t->decode(V{15, 3, 16, 17}), "hello \xC3\xA9");
  EXPECT_EQ(t->decode(V{15, 3, 16}), "hello " + kFffd);  // a lone lead byte
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_EQ(t->eos_id(), 2);
  EXPECT_TRUE(t->is_special(2));
  EXPECT_FALSE(t->is_special(15));
  EXPECT_EQ(t->vocab_size(), 19);
  EXPECT_EQ(t->decode(V{15, 19, 400, -1}), "hello");  // ids without a token decode to nothing
  EXPECT_THROW(t->encode("bad \xC3"), Error);
}

// Encoding polls the thread's CancellationScope: in a run of words and inside one long word
// (both loops of the BPE), and only there: outside a scope, or while it says no, text encodes.
TEST(Tokenizer, EncodingStopsWhenItsRequestIsCancelled) {
  auto t = make(llama2_style());
  std::string words, word;
  for (int i = 0; i < 20000; ++i) words += "hello ";
  for (int i = 0; i < 200000; ++i) word += "hello";
  const size_t n_words = t->encode(words).size(), n_word = t->encode(word).size();
  int polls = 0;
  bool cancel = false;
  CancellationScope scope([&] { return ++polls, cancel; });
  EXPECT_EQ(t->encode(words).size(), n_words);
  EXPECT_EQ(t->encode(word).size(), n_word);
  EXPECT_GT(polls, 10);
  cancel = true;
  for (const std::string& text : {words, word}) {
    try {
      t->encode(text);
      ADD_FAILURE() << "not cancelled";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tokenizing was cancelled"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(t->encode("hello").size(), 1u);  // a short text finishes before any poll
}

TEST(Tokenizer, AddedTokensHonourStripAndSingleWord) {
  json j = llama2_style();
  j["added_tokens"].push_back({{"id", 19},
                               {"content", "<x>"},
                               {"special", false},
                               {"lstrip", true},
                               {"rstrip", true},
                               {"normalized", false},
                               {"single_word", false}});
  j["added_tokens"].push_back({{"id", 20},
                               {"content", "wo"},
                               {"special", false},
                               {"lstrip", false},
                               {"rstrip", false},
                               {"normalized", false},
                               {"single_word", true}});
  auto t = make(j);
  using V = std::vector<int32_t>;
  // The spaces around <x> are absorbed into it; "hello" before and after is its own section.
  EXPECT_EQ(t->encode("hello  <x>  hello"), (V{15, 19, 15}));
  EXPECT_EQ(t->encode("wo"), (V{20}));               // a whole word
  EXPECT_EQ(t->encode("hello wo"), (V{15, 3, 20}));  // bounded by a space (kept: no lstrip)
  EXPECT_EQ(t->encode("wor"), (V{3, 18, 9}));        // inside a word: not the added token
}

TEST(Tokenizer, UnsupportedFeaturesAreRefusedByName) {
  auto refused = [](json j, const std::string& needle) {
    try {
      make(j);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  json j = llama2_style();
  j["normalizer"] = {{"type", "BertNormalizer"}};
  refused(j, "normalizer \"BertNormalizer\"");
  j = llama2_style();
  j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  refused(j, "pre_tokenizer \"BertPreTokenizer\"");
  j = llama2_style();
  j["decoder"] = {{"type", "WordPiece"}};
  refused(j, "decoder \"WordPiece\"");
  j = llama2_style();
  j["model"]["type"] = "Unigram";
  refused(j, "model type \"Unigram\"");
  j = llama2_style();
  j["model"]["dropout"] = 0.1;
  refused(j, "dropout");
  j = llama2_style();
  j["post_processor"] = {{"type", "Whatever"}};
  refused(j, "post_processor \"Whatever\"");
  j = llama2_style();
  j["truncation"] = {{"max_length", 8}};
  refused(j, "truncation");
  j = llama2_style();
  j["model"]["merges"].push_back("q z");
  refused(j, "merge 6");
  j = llama2_style();
  j["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  refused(j, "(unclosed");
  EXPECT_THROW(Tokenizer::from_json("{not json", "", "<test>"), Error);
  EXPECT_THROW(make(llama2_style(), R"({"bos_token": "<nope>"})"), Error);
}

}  // namespace
}  // namespace r3::text
