// POST /generate, SGLang style: {"input_ids": [...] | [[...], ...] or "text": "..." | [...],
// "sampling_params": {...}, "return_routed_experts", "routed_experts_start", "rid"}. The reply
// (one object, or a list for a batch) has "output_ids", "text" ("" when the model has no
// tokenizer) and "meta_info" with "finish_reason" ({"type": "stop"|"length"|"abort", "matched":
// the stop string or token id, ...}), "prompt_tokens", "completion_tokens",
// "cached_tokens", "output_token_logprobs" ([[logprob, token_id, null], ...]), "routed_experts"
// (DESIGN.md transport), "weight_version" (the label, a string) and "weight_versions" (the refit
// counter of each token).
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/route_reply.h"
#include "server/serving_names.h"
#include "text/tokenizer.h"

namespace r3::server {

struct GenerateRequest {
  std::vector<Job> jobs;
  const text::Tokenizer* tok = nullptr;  // the served model's, or null
  bool return_text_in_logprobs = false;
  bool batch = false;   // input_ids was a list of lists: reply with a list
  bool stream = false;  // SSE chunks (one prompt only)
  std::optional<std::string> rid;
  bool return_logprob = true;
  std::optional<RouteFormat> routes_format;  // as asked ("routed_experts_format")
  RouteReply routes;                         // as answered (the server resolves the default)
};

// seeds() gives a seed for a request without "sampling_params.seed" / "sampling_seed".
// tok: the model's tokenizer (null: none; "text" and stop strings are then a 400).
GenerateRequest parse_generate_request(const nlohmann::json& body,
                                       const std::function<uint64_t()>& seeds,
                                       const text::Tokenizer* tok = nullptr);

// meta_info.finish_reason of a finished output: {"type": stop, "matched"} / {length} / {abort}.
nlohmann::json generate_finish_reason(const RequestOutput& o);
// weight_version: the server's current weight version label (SGLang's string).
nlohmann::json generate_reply(const RequestOutput& o, const std::string& rid,
                              const GenerateRequest& req, const std::string& weight_version);

}  // namespace r3::server
