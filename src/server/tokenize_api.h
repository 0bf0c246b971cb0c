// vLLM's POST /tokenize ({"prompt", "add_special_tokens", "return_token_strs"} -> {"count",
// "max_model_len", "tokens", "token_strs"}) and POST /detokenize ({"tokens"} -> {"prompt"}), on
// the served model's tokenizer; a 400 naming the field for bad input, and when the model has
// none.
#pragma once
#include <nlohmann/json.hpp>

#include "text/tokenizer.h"

namespace r3::server {

nlohmann::json tokenize_reply(const nlohmann::json& body, const text::Tokenizer* tok,
                              int max_model_len);
nlohmann::json detokenize_reply(const nlohmann::json& body, const text::Tokenizer* tok);

}  // namespace r3::server
