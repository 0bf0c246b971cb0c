// Per-request sampling parameters and the sampler. Sampling draws from a counter-based generator
// keyed by (request seed, absolute position), so a request samples the same tokens whatever
// else the engine runs (DESIGN.md, numerics).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace r3 {

// What the sampler reads: copied into each step plan (no heap memory, so planning a step
// allocates nothing).
struct SamplerParams {
  float temperature = 1.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
};

struct SamplingParams {
  int max_tokens = 16;
  float temperature = 1.0f;  // 0 = greedy
  float top_p = 1.0f;
  int top_k = 0;             // 0 or -1 = off
  uint64_t seed = 0;
  std::vector<int> stop_token_ids;
  bool ignore_eos = false;
  bool logprobs = true;
  bool return_routed_experts = false;
  int routed_experts_start = 0;  // delta: return rows [start, S-1)

  // Throws r3::Error naming the bad parameter.
  void validate(int vocab_size) const;
  operator SamplerParams() const { return {temperature, top_p, top_k, seed}; }
};

struct Sample {
  int token = 0;
  float logprob = 0.f;  // log-softmax of the raw logits at the sampled token
  bool nonfinite = false;  // a logit was NaN or infinite: nothing was sampled
};

// logits: [V]. scratch: at least V floats + V ints of working memory held by the caller.
Sample sample_token(const float* logits, int V, const SamplerParams& p, int position,
                    std::vector<float>& scratch, std::vector<int>& order);

}  // namespace r3
