// Per-request sampling parameters and the sampler. Sampling draws from a counter-based generator
// keyed by (request seed, absolute position), so a request samples the same tokens whatever
// else the engine runs (DESIGN.md, numerics).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "step/sampler_params.h"

namespace r3 {

// Limits on stop strings: each is searched in the tail of the text after every token.
constexpr size_t kMaxStopStrings = 64, kMaxStopStringBytes = 1024;

struct SamplingParams {
  int max_tokens = 16;
  float temperature = 1.0f;  // 0 = greedy
  float top_p = 1.0f;
  int top_k = 0;  // 0 or -1 = off
  uint64_t seed = 0;
  std::vector<int> stop_token_ids;
  // Text (an engine with a tokenizer): generation stops when the text contains one of `stop`;
  // the text ends before it (or after it, with include_stop_str_in_output). The tokens, logprobs
  // and routes keep the token that completed it.
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  bool ignore_eos = false;
  bool logprobs = true;
  bool return_routed_experts = false;
  int routed_experts_start = 0;  // delta: return rows [start, S-1)
  // With return_routed_experts: each row also carries the gate weight of each chosen expert
  // (RouteArray::weights, float32, the ids' order), the weights the MoE block combined with.
  bool return_routed_expert_weights = false;
  // Streaming, with return_routed_experts: each unfinished output also carries the route rows
  // computed since the previous output (RequestOutput::routed_experts, its .start their first
  // row), so a stream can send a chunk's rows with its tokens; the finished output carries all
  // rows [start, S-1) as always.
  bool stream_routes = false;
  // Scoring: the top_logprobs most likely tokens at every generated (and scored prompt)
  // position, up to kMaxTopLogprobs; and the logprob of every prompt token at positions
  // [max(1, prompt_logprobs_start), P) given the tokens before it (-1: none). max_tokens 0 runs
  // the prompt only (prefill-only scoring, routes for its P-1 rows).
  int top_logprobs = 0;
  int prompt_logprobs_start = -1;

  // Throws r3::Error naming the bad parameter.
  void validate(int vocab_size) const;
  operator SamplerParams() const {
    return {temperature, top_p, top_k, seed, top_logprobs, prompt_logprobs_start};
  }
};

// The softmax normaliser of logits[0, V) as sample_token computes it, so a token's logprob is
// logits[t] - log_z, the same bits everywhere; log_z is non-finite when a logit is. scratch
// ends holding the numerators exp(l - max).
struct LogitStats {
  int argmax = 0;  // first index of the largest logit
  float max = 0.f;
  double z = 0.0;     // sum of exp(l - max), in a fixed order
  float log_z = 0.f;  // log(z) + max
};
LogitStats logit_stats(const float* logits, int V, std::vector<float>& scratch);
// The k best tokens of logits (k <= kMaxTopLogprobs), their logprobs logits[t] - log_z.
void top_logprobs(const float* logits, int V, float log_z, int k, TopLogprobs& out);

// logits: [V]. scratch: at least V floats + V ints of working memory held by the caller.
Sample sample_token(const float* logits, int V, const SamplerParams& p, int position,
                    std::vector<float>& scratch, std::vector<int>& order);

}  // namespace r3
