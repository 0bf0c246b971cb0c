// What turns a computed step into its results, outside the forward: the token ids of an
// overlapped step's placeholders (the previous step's samples), one token sampled per sampling
// sequence (keyed by its seed and position: sampling.h; with drafts, one per draft and the
// acceptance of each), and the prompt tokens the plan scores.
// The forward (ModelRunner) only computes hidden states and, on request, logits.
#pragma once
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "step/step_plan.h"

namespace r3 {

class ModelRunner;

class StepSampler {
 public:
  // ids[t] = the token id of planned token t: the plan's, or for a placeholder (-1) the sample the
  // previous step drew for that request and epoch (r3::Error if it drew none).
  void resolve_tokens(const StepPlan& plan, std::vector<int>& ids) const;
  // Fills `result` from the runner's logits of the step just computed: samples, then scores.
  void finish(const StepPlan& plan, ModelRunner& runner, ThreadPool* pool, StepResult& result);

 private:
  struct LastSample {
    uint64_t request_id, epoch;
    int token;
  };
  std::vector<LastSample> last_;  // the previous step's samples: at most max_num_seqs
  std::vector<int> rows_, seqs_;  // scratch: token indices and their sequences
  std::vector<Sample> samples_;   // scratch: one per sampled row
};

}  // namespace r3
