#include "engine/step_sampler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "engine/model_runner.h"
#include "engine/sampling.h"

namespace r3 {

void StepSampler::resolve_tokens(const StepPlan& plan, std::vector<int>& ids) const {
  ids.resize(plan.tokens.size());
  for (size_t t = 0; t < plan.tokens.size(); ++t) {
    const PlannedToken& tok = plan.tokens[t];
    int id = tok.token;
    if (id < 0) {
      const PlannedSeq& s = plan.seqs[size_t(tok.seq)];
      for (const LastSample& ls : last_)
        if (ls.request_id == s.request_id && ls.epoch == s.epoch) id = ls.token;
      if (id < 0)
        throw Error("overlap scheduling: no sampled token for request " +
                    std::to_string(s.request_id));
    }
    ids[t] = id;
  }
}

void StepSampler::finish(const StepPlan& plan, ModelRunner& runner, ThreadPool* pool,
                         StepResult& result) {
  const int V = runner.config().vocab_size, max_rows = runner.max_logit_rows();
  result.iter = plan.iter;
  result.seqs.resize(plan.seqs.size());
  // Every sampled row: a sequence's last token, or with drafts its last num_drafts + 1 tokens
  // (the row of its i-th token from there predicts position start + i + 1).
  rows_.clear();
  seqs_.clear();
  for (size_t s = 0; s < plan.seqs.size(); ++s) {
    const PlannedSeq& ps = plan.seqs[s];
    SeqResult& r = result.seqs[s];
    r.request_id = ps.request_id;
    r.epoch = ps.epoch;
    r.sampled = false;
    r.accepted = 0;
    r.more.clear();
    if (!ps.sample) continue;
    for (int d = ps.num_drafts; d >= 0; --d) {
      rows_.push_back(ps.first_token + ps.num_tokens - 1 - d);
      seqs_.push_back(int(s));
    }
  }
  samples_.resize(rows_.size());
  // Rows are sampled independently (each from its own seed and position), so all cores share
  // them, as many at a time as the runner's logits buffer holds.
  for (size_t b = 0; b < rows_.size(); b += size_t(max_rows)) {
    const int R = int(std::min(rows_.size() - b, size_t(max_rows)));
    const float* logits = runner.logits(rows_.data() + b, R);
    pool->parallel_for_each(R, [&](int64_t i) {
      thread_local std::vector<float> scratch;
      thread_local std::vector<int> order;
      const size_t row = b + size_t(i);
      const PlannedSeq& ps = plan.seqs[size_t(seqs_[row])];
      const int position = plan.tokens[size_t(rows_[row])].position + 1;
      samples_[row] =
          sample_token(logits + size_t(i) * size_t(V), V, ps.sampler, position, scratch, order);
    });
  }
  // Acceptance: a draft stands while it equals the token sampled at its position; the sample
  // at the first mismatch (or after the last draft) ends the sequence's tokens.
  last_.clear();
  for (size_t row = 0; row < rows_.size();) {
    const PlannedSeq& ps = plan.seqs[size_t(seqs_[row])];
    SeqResult& r = result.seqs[size_t(seqs_[row])];
    r.sampled = true;
    r.sample = samples_[row];
    int accepted = 0;
    while (accepted < ps.num_drafts && !samples_[row + size_t(accepted)].nonfinite &&
           samples_[row + size_t(accepted)].token ==
               plan.tokens[size_t(rows_[row + size_t(accepted)] + 1)].token) {
      ++accepted;
      r.more.push_back(samples_[row + size_t(accepted)]);
    }
    r.accepted = accepted;
    last_.push_back({r.request_id, r.epoch, r.more.empty() ? r.sample.token : r.more.back().token});
    row += size_t(ps.num_drafts) + 1;
  }
  // Prompt scoring: each scored row's log-softmax at its target and its top tokens, as many rows
  // at a time as the runner's logits buffer holds.
  result.scores.resize(plan.scores.size());
  for (size_t b = 0; b < plan.scores.size(); b += size_t(max_rows)) {
    const int R = int(std::min(plan.scores.size() - b, size_t(max_rows)));
    rows_.clear();
    for (int i = 0; i < R; ++i) rows_.push_back(plan.scores[b + size_t(i)].token_index);
    const float* logits = runner.logits(rows_.data(), R);
    pool->parallel_for_each(R, [&](int64_t i) {
      thread_local std::vector<float> scratch;
      const ScoreTarget& t = plan.scores[b + size_t(i)];
      const float* row = logits + size_t(i) * size_t(V);
      ScoreResult& out = result.scores[b + size_t(i)];
      const float log_z = logit_stats(row, V, scratch).log_z;
      out.nonfinite = !std::isfinite(log_z);
      out.logprob = row[t.target] - log_z;
      out.top.n = 0;
      const int k = plan.seqs[size_t(t.seq)].sampler.top_logprobs;
      if (k > 0 && !out.nonfinite) top_logprobs(row, V, log_z, k, out.top);
    });
  }
}

}  // namespace r3
