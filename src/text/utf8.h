// UTF-8 helpers the tokenizer and the detokeniser share: validation, the lossy decode that
// Hugging Face and the WHATWG decoder apply to byte-level tokens (each maximal invalid subpart
// becomes one U+FFFD), the complete prefix of a stream of bytes, and Unicode normalisation
// (utf8proc).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace r3::text {

// Length of the valid UTF-8 sequence at s[i] (1-4), or 0 if none starts there.
size_t utf8_sequence_length(std::string_view s, size_t i);
bool is_valid_utf8(std::string_view s);
// Invalid sequences replaced by U+FFFD, one per maximal subpart (Unicode 15, 3.9 U+FFFD
// substitution; Rust's from_utf8_lossy and JavaScript's TextDecoder do the same).
std::string utf8_lossy(std::string_view bytes);
// The longest prefix of `bytes` that does not end inside a character that more bytes could
// still complete (what a stream may show now).
size_t utf8_stable_prefix(std::string_view bytes);
// The characters of valid UTF-8 text, each as its bytes.
std::vector<std::string_view> utf8_chars(std::string_view s);
std::string utf8_encode(char32_t c);
char32_t utf8_decode_one(std::string_view s, size_t i, size_t* len);

// Unicode White_Space (what \s means to the tokenizers' regexes).
bool is_unicode_space(char32_t c);
// Letters, marks, digits and '_' (a "word" character for single_word added tokens).
bool is_word_char(char32_t c);

enum class NormalForm { NFC, NFD, NFKC, NFKD };
// s must be valid UTF-8 (NUL characters allowed).
std::string unicode_normalize(std::string_view s, NormalForm form);
std::string unicode_lowercase(std::string_view s);

}  // namespace r3::text
