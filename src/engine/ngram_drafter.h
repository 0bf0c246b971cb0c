// Speculative decoding's n-gram drafter (prompt lookup): the tokens that followed the most recent
// earlier occurrence of the request's last n tokens, for n from the largest window down to the
// smallest. A pure function of the request's own tokens, so a draft depends on nothing else the
// engine runs. What a draft is worth is decided by verification (Scheduler, StepSampler): the
// tokens emitted are the ones decoding without speculation samples, whatever was drafted.
#pragma once
#include <vector>

namespace r3 {

struct NgramDraftConfig {
  int min_window = 1;   // SGLang's speculative_ngram_min_match_window_size
  int max_window = 12;  // speculative_ngram_max_match_window_size
  // Tokens looked back over for a match: bounds a draft's cost on long contexts.
  int max_lookback = 4096;
};

// Up to max_drafts tokens proposed to follow tokens[0, n); `out` is cleared first and left empty
// when no window of the request's tail occurs earlier.
void ngram_draft(const int* tokens, int n, const NgramDraftConfig& cfg, int max_drafts,
                 std::vector<int>& out);

}  // namespace r3
