#include "server/tokenize_api.h"

#include "core/error.h"
#include "server/api_error.h"
#include "server/json_fields.h"

namespace r3::server {

namespace {
const text::Tokenizer& need(const text::Tokenizer* tok, const char* param) {
  if (!tok)
    throw bad_request(
        "the model has no tokenizer (no tokenizer.json; start r3 serve with --tokenizer DIR)",
        param);
  return *tok;
}
}  // namespace

json tokenize_reply(const json& b, const text::Tokenizer* tok, int max_model_len) {
  refuse_unknown_fields(b, "", {"model", "prompt", "add_special_tokens", "return_token_strs"});
  const text::Tokenizer& t = need(tok, "prompt");
  auto prompt = opt_string(b, "prompt", "prompt");
  if (!prompt) throw bad_request("missing \"prompt\" (a string)", "prompt");
  std::vector<int32_t> ids;
  try {
    ids = t.encode(*prompt, opt_bool(b, "add_special_tokens", "add_special_tokens").value_or(true));
  } catch (const Error& e) {
    throw bad_request(std::string("\"prompt\": ") + e.what(), "prompt");
  }
  json strs = nullptr;
  if (opt_bool(b, "return_token_strs", "return_token_strs").value_or(false)) {
    strs = json::array();
    for (int32_t id : ids) strs.push_back(t.id_to_token(id).value_or(""));
  }
  return {{"count", ids.size()},
          {"max_model_len", max_model_len},
          {"tokens", ids},
          {"token_strs", strs}};
}

json detokenize_reply(const json& b, const text::Tokenizer* tok) {
  refuse_unknown_fields(b, "", {"model", "tokens"});
  const text::Tokenizer& t = need(tok, "tokens");
  if (!b.contains("tokens") || b["tokens"].is_null())
    throw bad_request("missing \"tokens\" (a list of ids)", "tokens");
  const std::vector<int> ids = token_id_list(b["tokens"], "tokens");
  for (int id : ids)
    if (id < 0 || id >= t.vocab_size())
      throw bad_request("\"tokens\" holds " + std::to_string(id) +
                            ", outside the tokenizer's vocabulary [0, " +
                            std::to_string(t.vocab_size()) + ")",
                        "tokens");
  try {
    return {{"prompt", t.decode(std::vector<int32_t>(ids.begin(), ids.end()))}};
  } catch (const Error& e) {
    throw bad_request(std::string("\"tokens\": ") + e.what(), "tokens");
  }
}

}  // namespace r3::server
