// The seam between planning and computing: one engine step, planned by the scheduler and then
// immutable, and what computing it returns. A second backend (another device, another process)
// plugs in here: it takes a StepPlan and fills a StepResult (docs/ARCHITECTURE.md says what it
// must reproduce). One engine step, planned by the scheduler and then immutable: its `iter` id and,
// for every computed token, the request, absolute position and KV block id + generation. Capture,
// copy and commit of routes read only this snapshot, never live request state (DESIGN.md,
// lifetimes).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "step/sampler_params.h"

namespace r3 {

struct PlannedSeq {
  uint64_t request_id = 0;
  uint64_t epoch = 0;   // the request's preemption epoch when planned
  int first_token = 0;  // index of its first token in StepPlan::tokens
  int num_tokens = 0;
  int start_pos = 0;     // absolute position of its first token
  int table_offset = 0;  // its block table: StepPlan::block_tables[table_offset ...], covering
  int table_len = 0;     //   positions [0, start_pos + num_tokens)
  // Its sliding-window layers' block table (models with sliding_window layers):
  // StepPlan::window_tables[window_offset, + table_len), -1 where blocks wholly before every
  // query's window were freed.
  int window_offset = 0;
  int state_slot = -1;  // its recurrent state (models with Gated DeltaNet layers), else -1
  // Prefix caching of that state (engine/state_snapshots.h): before its first token the slot is
  // loaded from snapshot `snapshot_restore` (a prefix hit's end), and after `snapshot_tokens` of
  // its tokens the state is copied into snapshot `snapshot_write` (a block boundary); -1: none.
  int snapshot_restore = -1, snapshot_write = -1, snapshot_tokens = 0;
  bool sample = false;  // the last token's logits are sampled (position start_pos + num_tokens)
  // Speculative decoding: the last num_drafts tokens are drafts (engine/ngram_drafter.h). The
  // logits of the sequence's last num_drafts + 1 tokens are then sampled, each at its own
  // position, and the drafts are accepted while each equals the token sampled before it.
  int num_drafts = 0;
  // Hybrids (Gated DeltaNet): where the step keeps the recurrent state after each of the first
  // num_drafts tokens (ModelRunner::reserve_draft_states), so the state can go back to the last
  // accepted draft; -1 otherwise.
  int draft_slot = -1;
  SamplerParams sampler;  // copied: sampling must not read live request state
  bool first_token_pending =
      false;  // overlap: token 0 is the one being sampled by the previous step
  // Routes.
  bool wants_routes = false;
  int prefix_hit_tokens = 0;  // rows [0, hit) copied from the SharedRouteCache
  int hit_offset = 0;  // StepPlan::hit_generations[hit_offset + i]: generation of hit block i
  // Prompt scoring: StepPlan::scores[score_offset, score_offset + score_count).
  int score_offset = 0, score_count = 0;
};

// A prompt token scored in this step: the logits at plan token `token_index` (position p - 1)
// give the logprob of `target`, the prompt token at position p.
struct ScoreTarget {
  int seq = 0;          // index into StepPlan::seqs
  int token_index = 0;  // into StepPlan::tokens
  int target = 0;
  int position = 0;
};

struct PlannedToken {
  int seq = -1;  // index into StepPlan::seqs; -1 = padding
  int position = 0;
  int token = 0;
  int block = 0;  // KV block id (the scratch block for padding)
  uint64_t block_generation = 0;
  int slot = 0;          // offset in the block
  int window_block = 0;  // the same position's block in the sliding-window layers' pool
};

// Flat vectors only: a plan object is reused step after step without allocating.
struct StepPlan {
  uint64_t iter = 0;
  uint64_t weight_version = 0;
  std::vector<PlannedSeq> seqs;
  std::vector<PlannedToken> tokens;
  std::vector<int> block_tables;          // every sequence's block table, back to back
  std::vector<int> window_tables;         // the same for the sliding-window layers (or empty)
  std::vector<uint64_t> hit_generations;  // generations of prefix-hit blocks, back to back
  std::vector<ScoreTarget> scores;        // prompt tokens scored this step
  int num_padding = 0;
  bool any_routes = false;

  const int* block_table(const PlannedSeq& s) const { return block_tables.data() + s.table_offset; }
  const int* window_table(const PlannedSeq& s) const {
    return window_tables.data() + s.window_offset;
  }
  uint64_t hit_generation(const PlannedSeq& s, int block) const {
    return hit_generations[size_t(s.hit_offset + block)];
  }
  void clear() {
    seqs.clear();
    tokens.clear();
    block_tables.clear();
    window_tables.clear();
    hit_generations.clear();
    scores.clear();
    num_padding = 0;
    any_routes = false;
  }
};

struct SeqResult {
  uint64_t request_id = 0;
  uint64_t epoch = 0;
  bool sampled = false;
  Sample sample;
  // Speculative decoding: how many of the sequence's drafts were accepted, and the tokens sampled
  // after `sample`, one per accepted draft (the last of them, or `sample` when none was
  // accepted, is the token the first rejected draft's place gets, or the one after the last
  // draft). `sample` then `more` are what decoding without speculation emits, bit for bit.
  int accepted = 0;
  std::vector<Sample> more;
};

struct ScoreResult {
  float logprob = 0.f;
  bool nonfinite = false;
  TopLogprobs top;
};

struct StepResult {
  uint64_t iter = 0;
  std::vector<SeqResult> seqs;      // parallel to StepPlan::seqs
  std::vector<ScoreResult> scores;  // parallel to StepPlan::scores
};

}  // namespace r3
