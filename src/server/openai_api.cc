#include "server/openai_api.h"

#include "server/api_error.h"
#include "server/json_fields.h"

namespace r3::server {

using json = nlohmann::json;

namespace {

json logprobs_json(const RequestOutput& o, size_t from, const text::Tokenizer* tok) {
  json tokens = json::array(), lps = json::array(), offs = json::array(), tops = json::array();
  size_t offset = 0;  // text_offset: where each token's text starts in the choice's text
  for (size_t i = 0; i < from && tok; ++i) offset += token_text(tok, o.token_ids[i]).size();
  for (size_t i = from; i < o.token_ids.size(); ++i) {
    const std::string name = token_text(tok, o.token_ids[i]);
    tokens.push_back(name);
    lps.push_back(i < o.logprobs.size() ? json(double(o.logprobs[i])) : json(nullptr));
    offs.push_back(offset);
    if (tok) offset += name.size();
    if (i < o.top_logprobs.size()) {
      json d = json::object();
      for (int j = 0; j < o.top_logprobs[i].n; ++j)
        d[token_text(tok, o.top_logprobs[i].ids[j])] = double(o.top_logprobs[i].logprobs[j]);
      tops.push_back(d);
    }
  }
  return {{"tokens", tokens},
          {"token_logprobs", lps},
          {"top_logprobs", o.top_logprobs.empty() ? json(nullptr) : tops},
          {"text_offset", offs}};
}

// Every choice gets its own copy of its prompt and of stop_token_ids, so a small body could
// expand to gigabytes (prompts x n x stop ids). A request may expand to at most this much.
constexpr size_t kMaxChoices = size_t(1) << 16;
constexpr size_t kMaxExpandedIds = size_t(1) << 24;

void check_expansion(const std::vector<std::vector<int>>& prompts, size_t n, size_t stop_ids) {
  size_t ids = 0;
  for (const auto& p : prompts) ids += (p.size() + stop_ids) * n;
  const size_t choices = prompts.size() * n;
  if (choices > kMaxChoices || ids > kMaxExpandedIds)
    throw bad_request("the request is too large: " + std::to_string(choices) +
                          " choices (prompts x n) holding " + std::to_string(ids) +
                          " token ids with their stop_token_ids; the limits are " +
                          std::to_string(kMaxChoices) + " and " + std::to_string(kMaxExpandedIds) +
                          ": split it into several requests",
                      "prompt");
}

}  // namespace

void reject_unsupported_openai_options(const json& b) {
  auto nonzero = [&](const char* k) {
    auto v = opt_number(b, k, k);
    if (v && *v != 0.0) throw bad_request(std::string("\"") + k + "\" is not supported by r3", k);
  };
  nonzero("presence_penalty");
  nonzero("frequency_penalty");
  if (auto v = opt_number(b, "repetition_penalty", "repetition_penalty"); v && *v != 1.0)
    throw bad_request("\"repetition_penalty\" is not supported by r3", "repetition_penalty");
  if (auto e = opt_bool(b, "echo", "echo"); e && *e)
    throw bad_request("\"echo\" is not supported by r3 (the prompt ids are known to the caller)",
                      "echo");
  if (auto s = opt_string(b, "suffix", "suffix"); s && !s->empty())
    throw bad_request("\"suffix\" is not supported by r3", "suffix");
  if (b.contains("logit_bias") && !b["logit_bias"].is_null() && !b["logit_bias"].empty())
    throw bad_request("\"logit_bias\" is not supported by r3", "logit_bias");
}

// "token_id:N" is vLLM's return_tokens_as_token_ids form, for a model without a tokenizer.
std::string token_text(const text::Tokenizer* tok, int id) {
  if (tok) return tok->decode(std::vector<int32_t>{id}, false, false);
  return "token_id:" + std::to_string(id);
}

json completion_stop_reason(const RequestOutput& o) {
  if (o.finish_reason != "stop") return nullptr;
  if (!o.stop_str.empty())
    return o.stop_str;  // vLLM: the matched stop string, or the stop token id
  if (o.token_ids.empty()) return nullptr;
  return o.token_ids.back();
}

// vLLM's prompt_logprobs: one entry per prompt position, null for position 0, else
// {"<id>": {"logprob", "rank", "decoded_token"}} for the prompt token and the top alternatives
// (rank: 1-based among the alternatives; null for a prompt token outside them).
json prompt_logprobs_json(const RequestOutput& o, const text::Tokenizer* tok) {
  auto decoded = [&](int id) { return tok ? json(token_text(tok, id)) : json(nullptr); };
  json out = json::array();
  if (o.prompt_logprobs_start < 0) return nullptr;
  for (int p = 0; p < o.prompt_logprobs_start; ++p) out.push_back(nullptr);
  for (size_t i = 0; i < o.prompt_logprobs.size(); ++i) {
    const size_t pos = size_t(o.prompt_logprobs_start) + i;
    if (pos == 0) {
      out.push_back(nullptr);
      continue;
    }
    json d = json::object();
    if (i < o.prompt_top_logprobs.size())
      for (int j = 0; j < o.prompt_top_logprobs[i].n; ++j)
        d[std::to_string(o.prompt_top_logprobs[i].ids[j])] = {
            {"logprob", double(o.prompt_top_logprobs[i].logprobs[j])},
            {"rank", j + 1},
            {"decoded_token", decoded(o.prompt_top_logprobs[i].ids[j])}};
    const std::string id = std::to_string(o.prompt_token_ids[pos]);
    if (!d.contains(id))
      d[id] = {{"logprob", double(o.prompt_logprobs[i])},
               {"rank", nullptr},
               {"decoded_token", decoded(o.prompt_token_ids[pos])}};
    out.push_back(d);
  }
  return out;
}

CompletionRequest parse_completion_request(const json& b, const std::function<uint64_t()>& seeds,
                                           const text::Tokenizer* tok) {
  // OpenAI's and vLLM's completion fields r3 reads or checks (the request vocabulary's and
  // these); any other is refused by name.
  refuse_unknown_fields(
      b, "", FrontEnd::Completions,
      {"model", "n", "best_of", "stream", "stream_options", "echo", "suffix", "presence_penalty",
       "frequency_penalty", "repetition_penalty", "logit_bias", "user", "return_token_ids",
       "request_id", "routed_experts_format", "spaces_between_special_tokens",
       "add_special_tokens"});
  reject_unsupported_openai_options(b);
  if (!b.contains("prompt")) throw bad_request("missing \"prompt\"", "prompt");
  // vLLM's add_special_tokens (default true): the tokenizer template's BOS and the like.
  const bool add_special = opt_bool(b, "add_special_tokens", "add_special_tokens").value_or(true);
  SamplingParams defaults;  // OpenAI's: 16 tokens, top_k off
  defaults.max_tokens = 16;
  return completion_request(b, FrontEnd::Completions,
                            prompt_batch(b["prompt"], "prompt", tok, add_special), defaults, seeds,
                            tok);
}

CompletionRequest completion_request(const json& b, FrontEnd fe,
                                     std::vector<std::vector<int>> prompts, SamplingParams base,
                                     const std::function<uint64_t()>& seeds,
                                     const text::Tokenizer* tok) {
  CompletionRequest r;
  r.tok = tok;
  r.chat = fe == FrontEnd::Chat;
  r.num_prompts = prompts.size();
  r.n = size_t(opt_int(b, "n", "n", 1, 256).value_or(1));
  if (auto bo = opt_int(b, "best_of", "best_of", 1, 256); bo && size_t(*bo) != r.n)
    throw bad_request("\"best_of\" other than n is not supported by r3", "best_of");
  r.stream = opt_bool(b, "stream", "stream").value_or(false);
  if (r.chat) {
    // Chat's logprobs is true or false; top_logprobs the alternatives, with logprobs only.
    r.logprobs = opt_bool(b, "logprobs", "logprobs").value_or(false);
    const auto top = opt_int(b, "top_logprobs", "top_logprobs", 0, kMaxTopLogprobs);
    if (top && *top > 0 && !r.logprobs)
      throw bad_request("\"top_logprobs\" needs \"logprobs\": true", "top_logprobs");
    if (r.logprobs) r.top_logprobs = int(top.value_or(0));
  } else if (b.contains("logprobs") && !b["logprobs"].is_null()) {
    const json& lp = b["logprobs"];
    if (lp.is_boolean()) {
      r.logprobs = lp.get<bool>();
    } else {
      // OpenAI's int: the sampled token's logprob plus the k best alternatives per position.
      r.top_logprobs = int(*opt_int(b, "logprobs", "logprobs", 0, kMaxTopLogprobs));
      r.logprobs = true;
    }
  }
  r.return_token_ids = opt_bool(b, "return_token_ids", "return_token_ids").value_or(false);
  r.request_id = opt_string(b, "request_id", "request_id");
  if (r.request_id && r.request_id->empty())
    throw bad_request("\"request_id\" must not be empty", "request_id");

  const std::map<std::string, std::string> given =
      read_request_options(b, fe, base, tok != nullptr);
  // Accepted for compatibility: vLLM applies it to SentencePiece "slow" tokenizers only; r3 reads
  // tokenizer.json.
  (void)opt_bool(b, "spaces_between_special_tokens", "spaces_between_special_tokens");
  base.logprobs = true;
  base.top_logprobs = r.top_logprobs;
  if (auto k = opt_int(b, "prompt_logprobs", "prompt_logprobs", 0, kMaxTopLogprobs)) {
    base.prompt_logprobs_start = 0;
    base.top_logprobs = std::max(base.top_logprobs, int(*k));
    r.prompt_logprobs = true;
  }
  r.routes_format = opt_route_format(b);
  const auto start = given.find("routed_experts_start");
  // vLLM's routed_experts_prompt_start (vllm #51906) cuts within the prompt: [0, P].
  const bool prompt_start = start != given.end() && start->second == "routed_experts_prompt_start";
  const bool seeded = given.count("seed") > 0;
  check_expansion(prompts, r.n, base.stop_token_ids.size());

  for (auto& p : prompts) {
    if (prompt_start && size_t(base.routed_experts_start) > p.size())
      throw bad_request("\"routed_experts_prompt_start\" " +
                            std::to_string(base.routed_experts_start) + " is past the prompt's " +
                            std::to_string(p.size()) + " tokens (it cuts the prompt's routes only)",
                        "routed_experts_prompt_start");
    r.prompt_lens.push_back(p.size());
    for (size_t j = 0; j < r.n; ++j) {
      Job job{p, base};
      job.params.seed = seeded ? base.seed + j : seeds();
      r.jobs.push_back(std::move(job));
    }
  }
  return r;
}

json completion_choice(const RequestOutput& o, size_t index, const CompletionRequest& req) {
  json c = {{"index", index},
            {"text", o.text},
            {"token_ids", o.token_ids},
            {"finish_reason", o.finish_reason}};
  c["stop_reason"] = completion_stop_reason(o);
  c["logprobs"] = req.logprobs ? logprobs_json(o, 0, req.tok) : json(nullptr);
  if (req.prompt_logprobs) c["prompt_logprobs"] = prompt_logprobs_json(o, req.tok);
  if (req.return_token_ids) c["prompt_token_ids"] = o.prompt_token_ids;
  put_routes(c, o, req.routes);
  return c;
}

json completion_usage(const CompletionRequest& req, const std::vector<size_t>& completion_tokens) {
  size_t p = 0, c = 0;
  for (size_t n : req.prompt_lens) p += n;
  for (size_t n : completion_tokens) c += n;
  return {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}};
}

json completion_chunk_choice(const RequestOutput& o, size_t index, size_t from, size_t text_from,
                             const CompletionRequest& req) {
  std::vector<int> delta(o.token_ids.begin() + long(std::min(from, o.token_ids.size())),
                         o.token_ids.end());
  json c = {{"index", index},
            {"text", o.text.substr(std::min(text_from, o.text.size()))},
            {"token_ids", delta}};
  c["logprobs"] = req.logprobs ? logprobs_json(o, from, req.tok) : json(nullptr);
  if (o.finished) {
    c["finish_reason"] = o.finish_reason;
    c["stop_reason"] = completion_stop_reason(o);
    if (req.return_token_ids) c["prompt_token_ids"] = o.prompt_token_ids;
  } else {
    c["finish_reason"] = nullptr;
  }
  put_routes(c, o, req.routes, true);  // this chunk's rows, if any (the stream slices them)
  return c;
}

}  // namespace r3::server
