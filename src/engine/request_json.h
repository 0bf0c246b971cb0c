// JSON for requests and outputs, shared by `r3 generate` (JSONL), the HTTP server and tests.
// Request fields follow vLLM/SGLang names, read by the request vocabulary's JSONL column
// (engine/request_fields.h): prompt_token_ids (or prompt text), max_tokens (or max_new_tokens),
// temperature, top_p, top_k, seed, stop_token_ids, stop, include_stop_str_in_output,
// skip_special_tokens, ignore_eos, logprobs, return_routed_experts, routed_experts_start,
// return_routed_expert_weights (the output's routed_expert_weights: route_weights_to_json).
#pragma once
#include <nlohmann/json.hpp>
#include <vector>

#include "engine/engine.h"

namespace r3 {

struct ParsedRequest {
  std::vector<int> prompt;
  std::string
      prompt_text;  // "prompt" given as text instead of prompt_token_ids (tokenized by the caller)
  SamplingParams params;
};

// Throws r3::Error naming the field for missing or wrongly typed values.
ParsedRequest parse_request_json(const nlohmann::json& j);
// Reads only the sampling fields of j into p (unknown keys are ignored).
void read_sampling_params(const nlohmann::json& j, SamplingParams& p);
// index, prompt_token_ids, token_ids, text, logprobs, finish_reason (and stop_reason, the matched
// stop string), weight_versions and, when present, routed_experts in the transport format.
nlohmann::json output_to_json(const RequestOutput& o, int64_t index);

}  // namespace r3
