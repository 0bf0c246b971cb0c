// POST /v1/chat/completions, OpenAI/vLLM style: messages rendered with the model's chat template
// (or "chat_template"; "tools", "chat_template_kwargs" such as enable_thinking,
// "add_generation_prompt", "continue_final_message"), then sampled as a completion of the
// rendered prompt's ids. Choices carry "message" {"role", "content"}, "logprobs" {"content":
// [{"token", "logprob", "bytes", "top_logprobs"}]}, "finish_reason", "stop_reason", "token_ids"
// and the routes where vLLM places them; the reply has "prompt_token_ids". Streams send
// "chat.completion.chunk" deltas. r3 parses no tool calls out of the text: "tool_choice" other
// than "none"/"auto" is a 400.
#pragma once
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "server/openai_api.h"
#include "text/tokenizer.h"

namespace r3::server {

// How a server renders chat templates: a request's own "chat_template" is refused (400, vLLM's
// message) unless trusted (--trust-request-chat-template); every render, the model's template
// too, runs within its budget (text/jinja_budget.h) and stops when `cancelled` says so (client
// gone, shutdown).
struct ChatTemplatePolicy {
  bool trust_request_chat_template = false;
  std::function<bool()> cancelled;
};

// body: the parsed request; raw: its text (messages and tools keep their key order, which
// tojson in a template prints). max_context: the most tokens a request may hold (positions and
// KV pool); without max_tokens a chat completion may use all that the prompt leaves.
CompletionRequest parse_chat_request(const nlohmann::json& body, const std::string& raw,
                                     const std::function<uint64_t()>& seeds,
                                     std::shared_ptr<const text::Tokenizer> tok, int max_context,
                                     const ChatTemplatePolicy& policy = {});
nlohmann::json chat_choice(const RequestOutput& o, size_t index, const CompletionRequest& req);
// One streamed choice delta (tokens [from, end), text bytes [text_from, end)); `first` adds the
// assistant role.
nlohmann::json chat_chunk_choice(const RequestOutput& o, size_t index, size_t from,
                                 size_t text_from, bool first, const CompletionRequest& req);

}  // namespace r3::server
