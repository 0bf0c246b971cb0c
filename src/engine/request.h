// A request's live state, owned by the engine and changed only on the engine thread.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampling.h"
#include "text/detokenizer.h"

namespace r3 {

enum class RequestStatus { Waiting, Running, Finished };

struct Request {
  uint64_t id = 0;
  uint64_t arrival = 0;
  std::vector<int> prompt;
  SamplingParams params;
  RequestStatus status = RequestStatus::Waiting;
  std::string finish_reason;  // "length", "stop", "abort"
  // Its submission (requests of one group wait in FIFO order, groups take turns: WaitingQueue),
  // and its place in its group's list while waiting (O(1) removal).
  uint64_t group = 0;
  std::list<Request*>::iterator waiting_at;
  bool in_waiting = false;

  std::vector<int> output;         // sampled tokens
  std::vector<float> logprobs;     // of each sampled token
  std::vector<uint64_t> versions;  // weight version that produced each sampled token
  std::vector<TopLogprobs> top;    // of each sampled token, when top_logprobs > 0
  // Scoring (prompt_logprobs_start >= 0): per prompt position, NaN until scored.
  std::vector<float> prompt_logprobs;
  std::vector<TopLogprobs> prompt_top;
  // Text (an engine with a tokenizer): the detokenised output, cut at a matched stop string.
  std::unique_ptr<text::IncrementalDetokenizer> detok;
  std::string text;
  std::string stop_str;      // the stop string that finished it, if one did
  int routes_streamed = -1;  // stream_routes: rows before this went out already (-1: none yet)

  // KV state.
  std::vector<int> blocks;  // block table
  // Sliding-window layers' block table (their own pool): -1 for blocks freed because every
  // later query's window starts after them; window_freed of them, from the start.
  std::vector<int> window_blocks;
  int window_freed = 0;
  std::vector<uint64_t> block_hashes;  // chained hashes of the first full blocks
  int state_slot = -1;        // its Gated DeltaNet state while running (Scheduler), else -1
  int restore_snapshot = -1;  // a prefix hit's state snapshot, until its first step is planned
  // The snapshot it last took past its prompt (slot and reservation generation), superseded by
  // the next one: a finished turn leaves one snapshot near its end for the next turn to hit.
  int trail_snapshot = -1;
  uint64_t trail_generation = 0;
  int num_computed = 0;     // tokens whose KV is computed or scheduled
  int pending = 0;          // sampled tokens not yet known (overlap scheduling)
  uint64_t epoch = 0;       // bumped by preemption: in-flight results are stale
  uint64_t kv_version = 0;  // weight version its KV was started under
  int num_preemptions = 0;
  // Speculative decoding: drafts its next step may take (Scheduler): one more than its last step
  // accepted, so a request in a stretch the drafter predicts drafts the most and one it does
  // not, a single token (a draft costs a token of verification whether or not it stands).
  int draft_budget = 1;
  int prefix_hit_tokens = 0;     // of the current admission (routes to copy)
  bool first_step_done = false;  // the current admission's first step was planned
  std::vector<uint64_t> hit_generations;

  int num_tokens() const { return int(prompt.size() + output.size()); }
  int token(int i) const {
    return i < int(prompt.size()) ? prompt[size_t(i)] : output[size_t(i) - prompt.size()];
  }
  bool is_decode() const { return num_computed >= int(prompt.size()); }
};

}  // namespace r3
