// POST /v1/completions, OpenAI style: request parsing and reply/stream-chunk building. Prompts
// are text (the model's tokenizer) or token ids; every choice carries "text" ("" when the model
// has no tokenizer) and "token_ids"; routes travel as the extension field "routed_experts"
// (DESIGN.md transport).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/request_fields.h"
#include "server/route_reply.h"
#include "server/serving_names.h"

namespace r3::server {

struct CompletionRequest {
  std::vector<Job> jobs;                 // choice i = prompt i / n, sample i % n
  const text::Tokenizer* tok = nullptr;  // the served model's, or null
  bool chat = false;                     // /v1/chat/completions (chat_api.h)
  size_t num_prompts = 0, n = 1;
  bool stream = false;
  bool logprobs = false;                  // return the sampled tokens' logprobs
  int top_logprobs = 0;                   // "logprobs": k, the k best alternatives per position
  bool prompt_logprobs = false;           // vLLM's "prompt_logprobs": k
  bool return_token_ids = false;          // also return each choice's prompt_token_ids
  std::optional<std::string> request_id;  // the client's id for the call (for /abort)
  std::vector<size_t> prompt_lens;
  std::optional<RouteFormat> routes_format;  // as asked ("routed_experts_format")
  RouteReply routes;                         // as answered (the server resolves the default)
};

// seeds() gives a fresh seed for every choice when the request has none; with "seed" given,
// sample j of each prompt uses seed + j (so n > 1 gives n different samples, reproducibly).
// tok: the model's tokenizer (null: none; text prompts and stop strings are then a 400).
CompletionRequest parse_completion_request(const nlohmann::json& body,
                                           const std::function<uint64_t()>& seeds,
                                           const text::Tokenizer* tok = nullptr);
// Options r3 does not implement (penalties, echo, suffix, logit_bias): a non-default value is a
// 400 naming it, never silently ignored. Completions and chat check it before anything else.
void reject_unsupported_openai_options(const nlohmann::json& body);
// The part completions and chat share, once the prompts are token ids: n, stream, logprobs in
// the front end's shape, the request vocabulary's options over `base` (the front end's
// defaults), seeds, routes' cut. Chat builds its request here directly (chat_api.cc).
CompletionRequest completion_request(const nlohmann::json& body, FrontEnd fe,
                                     std::vector<std::vector<int>> prompts, SamplingParams base,
                                     const std::function<uint64_t()>& seeds,
                                     const text::Tokenizer* tok);

// A token as vLLM names it in logprobs: its text, or "token_id:N" without a tokenizer.
std::string token_text(const text::Tokenizer* tok, int id);
// vLLM's stop_reason: the matched stop string, the stop token id, or null.
nlohmann::json completion_stop_reason(const RequestOutput& o);

// vLLM's prompt_logprobs: one entry per prompt position, null for position 0, else
// {"<id>": {"logprob", "rank", "decoded_token"}}; null when the prompt was not scored.
nlohmann::json prompt_logprobs_json(const RequestOutput& o, const text::Tokenizer* tok);

// One choice of a non-streamed reply.
nlohmann::json completion_choice(const RequestOutput& o, size_t index,
                                 const CompletionRequest& req);
// {"prompt_tokens","completion_tokens","total_tokens"}
nlohmann::json completion_usage(const CompletionRequest& req,
                                const std::vector<size_t>& completion_tokens);
// One streamed choice delta: tokens [from, end) and text bytes [text_from, end) of o; finished
// outputs carry finish_reason and routes.
nlohmann::json completion_chunk_choice(const RequestOutput& o, size_t index, size_t from,
                                       size_t text_from, const CompletionRequest& req);

}  // namespace r3::server
