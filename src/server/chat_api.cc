#include "server/chat_api.h"

#include "core/error.h"
#include "server/api_error.h"
#include "server/json_fields.h"
#include "text/chat_template.h"

namespace r3::server {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

json chat_logprobs(const RequestOutput& o, size_t from, const CompletionRequest& req) {
  json content = json::array();
  for (size_t i = from; i < o.token_ids.size(); ++i) {
    const std::string t = token_text(req.tok, o.token_ids[i]);
    json top = json::array();
    if (i < o.top_logprobs.size())
      for (int j = 0; j < o.top_logprobs[i].n; ++j) {
        const std::string a = token_text(req.tok, o.top_logprobs[i].ids[j]);
        top.push_back({{"token", a},
                       {"logprob", double(o.top_logprobs[i].logprobs[j])},
                       {"bytes", bytes_of(a)}});
      }
    content.push_back(
        {{"token", t},
         {"logprob", i < o.logprobs.size() ? json(double(o.logprobs[i])) : json(nullptr)},
         {"bytes", bytes_of(t)},
         {"top_logprobs", top}});
  }
  return {{"content", content}};
}

}  // namespace

CompletionRequest parse_chat_request(const json& b, const std::string& raw,
                                     const std::function<uint64_t()>& seeds,
                                     std::shared_ptr<const text::Tokenizer> tok, int max_context,
                                     const ChatTemplatePolicy& policy) {
  // The chat fields r3 reads or checks (the request vocabulary's and these); any other is refused
  // by name.
  refuse_unknown_fields(b, "", FrontEnd::Chat,
                        {"model",
                         "n",
                         "stream",
                         "stream_options",
                         "logprobs",
                         "presence_penalty",
                         "frequency_penalty",
                         "repetition_penalty",
                         "logit_bias",
                         "user",
                         "tools",
                         "tool_choice",
                         "parallel_tool_calls",
                         "chat_template",
                         "chat_template_kwargs",
                         "add_generation_prompt",
                         "continue_final_message",
                         "spaces_between_special_tokens",
                         "return_token_ids",
                         "request_id",
                         "routed_experts_format",
                         "echo",
                         "response_format",
                         "add_special_tokens"});
  reject_unsupported_openai_options(b);
  if (!tok)
    throw bad_request(
        "the model has no tokenizer (no tokenizer.json; start r3 serve with --tokenizer DIR)",
        "messages");
  // vLLM's rule and words: a template sent with the request (or in chat_template_kwargs) is code
  // from the client, rendered only when the server was told to trust it.
  const bool sends_template =
      (b.contains("chat_template") && !b["chat_template"].is_null()) ||
      (b.contains("chat_template_kwargs") && b["chat_template_kwargs"].is_object() &&
       b["chat_template_kwargs"].contains("chat_template") &&
       !b["chat_template_kwargs"]["chat_template"].is_null());
  if (sends_template && !policy.trust_request_chat_template)
    throw bad_request(
        "Chat template is passed with request, but --trust-request-chat-template is not set. "
        "Refused request with untrusted chat template.",
        "chat_template");
  if (b.contains("response_format") && !b["response_format"].is_null()) {
    const json& rf = b["response_format"];
    if (!rf.is_object() || rf.value("type", "") != "text")
      throw bad_request(
          "\"response_format\" other than {\"type\": \"text\"} is not supported by r3 (no "
          "constrained decoding)",
          "response_format");
  }
  if (b.contains("tool_choice") && !b["tool_choice"].is_null()) {
    const json& tc = b["tool_choice"];
    if (!tc.is_string() || (tc != "none" && tc != "auto"))
      throw bad_request(
          "\"tool_choice\" other than \"none\" or \"auto\" is not supported by r3 (it parses no "
          "tool calls)",
          "tool_choice");
  }
  const ojson ob = ojson::parse(raw);  // key order of messages and tools, for the template
  text::ChatRequest cr;
  if (!ob.contains("messages") || !ob["messages"].is_array() || ob["messages"].empty())
    throw bad_request("\"messages\" must be a non-empty list", "messages");
  cr.messages = ob["messages"];
  // r3 serves text: image, audio and video parts (OpenAI's content-part types) are refused by
  // name rather than dropped or rendered as text by the template.
  for (size_t i = 0; i < cr.messages.size(); ++i) {
    const ojson& m = cr.messages[i];
    if (!m.is_object() || !m.contains("content") || !m["content"].is_array()) continue;
    for (const ojson& part : m["content"])
      if (part.is_object() && part.contains("type") && part["type"] != "text")
        throw bad_request("messages[" + std::to_string(i) + "]: content of type " +
                              part["type"].dump() +
                              " is not supported by r3 (text only; a vision-language model's "
                              "vision tower is not run)",
                          "messages");
  }
  if (ob.contains("tools") && !ob["tools"].is_null()) {
    if (!ob["tools"].is_array()) throw bad_request("\"tools\" must be a list", "tools");
    if (!(b.contains("tool_choice") && b["tool_choice"] == "none")) cr.tools = ob["tools"];
  }
  if (ob.contains("chat_template_kwargs") && !ob["chat_template_kwargs"].is_null()) {
    if (!ob["chat_template_kwargs"].is_object())
      throw bad_request("\"chat_template_kwargs\" must be an object", "chat_template_kwargs");
    cr.kwargs = ob["chat_template_kwargs"];
  }
  cr.continue_final_message =
      opt_bool(b, "continue_final_message", "continue_final_message").value_or(false);
  cr.add_generation_prompt = opt_bool(b, "add_generation_prompt", "add_generation_prompt")
                                 .value_or(!cr.continue_final_message);
  std::vector<int32_t> ids;
  try {
    const text::ChatTemplate ct(tok, opt_string(b, "chat_template", "chat_template").value_or(""));
    const std::string prompt = ct.render(cr, policy.cancelled);
    // Too long for the context by its bytes alone: refused before encoding (a 15 MB tools list
    // cost 12 s of encoding before its 400).
    const size_t at_least = prompt.size() / (4 * tok->max_token_bytes());
    if (at_least > size_t(max_context))
      throw bad_request("the rendered prompt has " + std::to_string(prompt.size()) +
                            " bytes, at least " + std::to_string(at_least) +
                            " tokens: more than the " + std::to_string(max_context) +
                            " the model and KV pool hold",
                        "messages");
    ids = tok->encode(prompt,
                      opt_bool(b, "add_special_tokens", "add_special_tokens").value_or(false));
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    throw bad_request(std::string("chat template: ") + e.what(), "messages");
  }
  // The rest is a completion of the rendered prompt; vLLM's chat default for max_tokens is as
  // many tokens as the context leaves.
  SamplingParams defaults;
  defaults.max_tokens = int(std::max<int64_t>(1, int64_t(max_context) - int64_t(ids.size())));
  return completion_request(b, FrontEnd::Chat, {std::vector<int>(ids.begin(), ids.end())}, defaults,
                            seeds, tok.get());
}

json chat_choice(const RequestOutput& o, size_t index, const CompletionRequest& req) {
  json c = {{"index", index},
            {"message",
             {{"role", "assistant"},
              {"content", o.text},
              {"reasoning_content", nullptr},
              {"tool_calls", json::array()}}},
            {"logprobs", req.logprobs ? chat_logprobs(o, 0, req) : json(nullptr)},
            {"finish_reason", o.finish_reason},
            {"stop_reason", completion_stop_reason(o)},
            {"token_ids", o.token_ids}};
  if (req.prompt_logprobs) c["prompt_logprobs"] = prompt_logprobs_json(o, req.tok);
  put_routes(c, o, req.routes);
  return c;
}

json chat_chunk_choice(const RequestOutput& o, size_t index, size_t from, size_t text_from,
                       bool first, const CompletionRequest& req) {
  json delta = json::object();
  if (first) delta["role"] = "assistant";
  const std::string text = o.text.substr(std::min(text_from, o.text.size()));
  if (first || !text.empty()) delta["content"] = text;
  std::vector<int> ids(o.token_ids.begin() + long(std::min(from, o.token_ids.size())),
                       o.token_ids.end());
  json c = {{"index", index}, {"delta", delta}, {"token_ids", ids}};
  c["logprobs"] = req.logprobs ? chat_logprobs(o, from, req) : json(nullptr);
  if (o.finished) {
    c["finish_reason"] = o.finish_reason;
    c["stop_reason"] = completion_stop_reason(o);
  } else {
    c["finish_reason"] = nullptr;
  }
  put_routes(c, o, req.routes, true);  // this chunk's rows, if any (the stream slices them)
  return c;
}

}  // namespace r3::server
