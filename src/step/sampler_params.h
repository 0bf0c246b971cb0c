// What a step plan carries for sampling each sequence, and the fixed-size top-logprobs a step
// result carries back (part of the StepPlan -> StepResult seam, step_plan.h).
#pragma once
#include <cstdint>

namespace r3 {

// What the sampler reads: copied into each step plan (no heap memory, so planning a step
// allocates nothing).
struct SamplerParams {
  float temperature = 1.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  int top_logprobs = 0;            // alternatives reported per scored position
  int prompt_logprobs_start = -1;  // score prompt tokens from this position (-1: none)
};

constexpr int kMaxTopLogprobs = 20;  // as OpenAI's and vLLM's limit

// The k most likely tokens of one position: descending logprob, ties to the lower id. Fixed
// capacity, so results carry no heap memory.
struct TopLogprobs {
  int n = 0;
  int ids[kMaxTopLogprobs];
  float logprobs[kMaxTopLogprobs];
};

// One sequence's sampled token, as a step result reports it.
struct Sample {
  int token = 0;
  float logprob = 0.f;     // log-softmax of the raw logits at the sampled token
  bool nonfinite = false;  // a logit was NaN or infinite: nothing was sampled
  TopLogprobs top;         // the top_logprobs alternatives (n = 0 when not asked)
};

}  // namespace r3
