#include "server/generate_api.h"

#include <cmath>

#include "server/api_error.h"
#include "server/json_fields.h"

namespace r3::server {

using json = nlohmann::json;

namespace {

void reject_unsupported(const json& sp) {
  auto need = [&](const char* k, double dflt) {
    const std::string param = std::string("sampling_params.") + k;
    auto v = opt_number(sp, k, param);
    if (v && *v != dflt) throw bad_request("\"" + param + "\" is not supported by r3", param);
  };
  need("frequency_penalty", 0.0);
  need("presence_penalty", 0.0);
  need("repetition_penalty", 1.0);
  need("min_new_tokens", 0.0);
  need("n", 1.0);
  for (const char* k : {"regex", "json_schema", "ebnf", "structural_tag"})
    if (sp.contains(k) && !sp[k].is_null())
      throw bad_request(std::string("\"sampling_params.") + k + "\" is not supported by r3",
                        std::string("sampling_params.") + k);
}

// Every prompt gets its own copy of stop_token_ids, so a small body could expand to gigabytes
// (prompts x stop ids). A request may expand to at most this much.
constexpr size_t kMaxPrompts = size_t(1) << 16;
constexpr size_t kMaxExpandedIds = size_t(1) << 24;

void check_expansion(const std::vector<std::vector<int>>& prompts, size_t stop_ids) {
  size_t ids = 0;
  for (const auto& p : prompts) ids += p.size() + stop_ids;
  if (prompts.size() > kMaxPrompts || ids > kMaxExpandedIds)
    throw bad_request("the request is too large: " + std::to_string(prompts.size()) +
                          " prompts holding " + std::to_string(ids) +
                          " token ids with their stop_token_ids; the limits are " +
                          std::to_string(kMaxPrompts) + " and " + std::to_string(kMaxExpandedIds) +
                          ": split it into several requests",
                      "input_ids");
}

}  // namespace

GenerateRequest parse_generate_request(const json& b, const std::function<uint64_t()>& seeds,
                                       const text::Tokenizer* tok) {
  // SGLang's GenerateReqInput fields r3 reads or checks (the request vocabulary's and these);
  // any other (image_data, lora_path, return_hidden_states, ...) is refused by name.
  refuse_unknown_fields(b, "", FrontEnd::Generate,
                        {"text", "rid", "stream", "return_logprob", "return_text_in_logprobs",
                         "routed_experts_format", "log_metrics"});
  GenerateRequest r;
  r.tok = tok;
  r.return_text_in_logprobs =
      opt_bool(b, "return_text_in_logprobs", "return_text_in_logprobs").value_or(false);
  if (r.return_text_in_logprobs && !tok)
    throw bad_request("the model has no tokenizer: \"return_text_in_logprobs\" cannot be served",
                      "return_text_in_logprobs");
  const bool has_text = b.contains("text") && !b["text"].is_null();
  const bool has_ids = b.contains("input_ids") && !b["input_ids"].is_null();
  if (has_text && has_ids) throw bad_request("give one of \"text\" and \"input_ids\"", "text");
  if (!has_text && !has_ids) throw bad_request("missing \"input_ids\" (or \"text\")", "input_ids");
  if (has_text && !b["text"].is_string() && !b["text"].is_array())
    throw bad_request("\"text\" must be a string or a list of strings", "text");
  r.stream = opt_bool(b, "stream", "stream").value_or(false);
  const json& prompt = has_text ? b["text"] : b["input_ids"];
  r.batch =
      has_text ? prompt.is_array() : (prompt.is_array() && !prompt.empty() && prompt[0].is_array());
  if (r.stream && r.batch)
    throw bad_request(
        "\"stream\" with a list of prompts is not supported by r3: stream each prompt as its own "
        "call",
        "stream");
  std::vector<std::vector<int>> prompts =
      prompt_batch(prompt, has_text ? "text" : "input_ids", tok);
  if (b.contains("rid") && !b["rid"].is_null()) {
    if (b["rid"].is_string()) {
      if (!b["rid"].get<std::string>().empty()) r.rid = b["rid"].get<std::string>();
    } else if (b["rid"].is_number_integer())
      r.rid = b["rid"].dump();
    else
      throw bad_request("\"rid\" must be a string", "rid");
  }
  r.return_logprob = opt_bool(b, "return_logprob", "return_logprob").value_or(true);
  r.routes_format = opt_route_format(b);

  static const json kEmpty = json::object();
  const json& sp = b.contains("sampling_params") && !b["sampling_params"].is_null()
                       ? b["sampling_params"]
                       : kEmpty;
  if (!sp.is_object())
    throw bad_request("\"sampling_params\" must be an object", "sampling_params");
  reject_unsupported(sp);
  refuse_unknown_fields(sp, "sampling_params.", FrontEnd::Generate,
                        {"min_new_tokens", "min_p", "n", "frequency_penalty", "presence_penalty",
                         "repetition_penalty", "regex", "json_schema", "ebnf", "structural_tag",
                         "spaces_between_special_tokens", "stream_interval"});
  if (auto v = opt_number(sp, "min_p", "sampling_params.min_p"); v && *v != 0.0)
    throw bad_request("\"sampling_params.min_p\" is not supported by r3", "sampling_params.min_p");
  SamplingParams p;    // SGLang's defaults; the request vocabulary reads the rest
  p.max_tokens = 128;  // 0: prefill only (scoring: input_token_logprobs and routes)
  p.top_k = -1;
  p.logprobs = true;
  const std::map<std::string, std::string> given =
      read_request_options(b, FrontEnd::Generate, p, tok != nullptr);
  // Accepted for compatibility: it only changes SentencePiece "slow" tokenizers, and r3 reads
  // tokenizer.json (vLLM and SGLang ignore it for those too).
  (void)opt_bool(sp, "spaces_between_special_tokens",
                 "sampling_params.spaces_between_special_tokens");
  // SGLang's scoring fields: logprob_start_len -1 (default) = output tokens only, N = input
  // tokens from position N as well; top_logprobs_num = alternatives per position.
  if (r.return_logprob) {
    p.prompt_logprobs_start =
        int(opt_int(b, "logprob_start_len", "logprob_start_len", -1, INT32_MAX).value_or(-1));
    p.top_logprobs =
        int(opt_int(b, "top_logprobs_num", "top_logprobs_num", 0, kMaxTopLogprobs).value_or(0));
  }
  const bool seeded = given.count("seed") > 0;
  check_expansion(prompts, p.stop_token_ids.size());
  for (auto& prompt : prompts) {
    Job j{std::move(prompt), p};
    if (!seeded) j.params.seed = seeds();
    r.jobs.push_back(std::move(j));
  }
  return r;
}

json generate_finish_reason(const RequestOutput& o) {
  json fr;
  if (o.finish_reason == "stop") {
    fr = {{"type", "stop"},
          {"matched", !o.stop_str.empty()   ? json(o.stop_str)
                      : o.token_ids.empty() ? json(nullptr)
                                            : json(o.token_ids.back())}};
  } else if (o.finish_reason == "length") {
    fr = {{"type", "length"}, {"length", o.token_ids.size()}};
  } else {
    fr = {{"type", o.finish_reason}, {"message", "the request was aborted"}};
  }
  return fr;
}

json generate_reply(const RequestOutput& o, const std::string& rid, const GenerateRequest& req,
                    const std::string& weight_version) {
  json meta = {{"id", rid},
               {"finish_reason", generate_finish_reason(o)},
               {"prompt_tokens", o.prompt_token_ids.size()},
               {"completion_tokens", o.token_ids.size()},
               {"cached_tokens", o.num_cached_tokens},
               {"weight_version", weight_version},
               {"weight_versions", o.weight_versions}};
  if (req.return_logprob) {
    // SGLang's shapes: [logprob, token_id, text] per position (text: the token's text with
    // return_text_in_logprobs, else null), and per position a list of such triples for the top
    // alternatives.
    auto triple = [&](float lp, int id) {
      const json txt = req.return_text_in_logprobs
                           ? json(req.tok->decode(std::vector<int32_t>{id}, false, false))
                           : json(nullptr);
      return json::array({std::isnan(lp) ? json(nullptr) : json(double(lp)), id, txt});
    };
    auto tops = [&](const TopLogprobs& t) {
      json a = json::array();
      for (int j = 0; j < t.n; ++j) a.push_back(triple(t.logprobs[j], t.ids[j]));
      return a;
    };
    json lps = json::array();
    for (size_t i = 0; i < o.token_ids.size(); ++i)
      lps.push_back(triple(i < o.logprobs.size() ? o.logprobs[i] : NAN, o.token_ids[i]));
    meta["output_token_logprobs"] = lps;
    if (!o.top_logprobs.empty()) {
      json t = json::array();
      for (const TopLogprobs& x : o.top_logprobs) t.push_back(tops(x));
      meta["output_top_logprobs"] = t;
    }
    if (o.prompt_logprobs_start >= 0) {
      json in = json::array(), in_top = json::array();
      for (size_t i = 0; i < o.prompt_logprobs.size(); ++i) {
        const size_t pos = size_t(o.prompt_logprobs_start) + i;
        in.push_back(triple(o.prompt_logprobs[i], o.prompt_token_ids[pos]));
        if (!o.prompt_top_logprobs.empty())
          in_top.push_back(pos == 0 ? json(nullptr) : tops(o.prompt_top_logprobs[i]));
      }
      meta["input_token_logprobs"] = in;
      if (!o.prompt_top_logprobs.empty()) meta["input_top_logprobs"] = in_top;
    }
  }
  meta["routed_experts"] = nullptr;
  put_routes(meta, o, req.routes);
  if (o.routed_experts) meta["routed_experts_start_len"] = o.routed_experts->start;
  return {{"text", o.text}, {"output_ids", o.token_ids}, {"meta_info", meta}};
}

}  // namespace r3::server
