// Continuous batching with chunked prefill, prefix caching and preemption by recompute.
// Each step gets a token budget (max_num_batched_tokens) and at most max_num_seqs requests;
// running decodes go first, then running prefills, then waiting requests in arrival order
// (preempted ones at the front, so nobody starves). When blocks run out, the most recently
// arrived running request is preempted: its blocks are released (cached full blocks keep their
// hash, so it reuses them on resume) and it recomputes later.
// Models with sliding-window layers keep those layers' KV in a second pool (window_pool) with a
// second block table per request: a block wholly before the window of the next query to compute
// is released while the request runs (it keeps its hash, so a later prefix hit may still use
// it), so those layers hold about window / block_size blocks per request however long it runs.
// A prefix hit then needs, besides the full layers' blocks, the sliding layers' blocks of the
// window before its end; it is shortened until they are cached.
#pragma once
#include <list>
#include <map>
#include <memory>
#include <vector>

#include "engine/kv_pool.h"
#include "engine/request.h"
#include "engine/waiting_queue.h"
#include "step/step_plan.h"

namespace r3 {

struct SchedulerConfig {
  int max_num_seqs = 32;
  int max_num_batched_tokens = 512;
  bool enable_prefix_caching = true;
  std::vector<int> decode_buckets;  // pad pure-decode steps to these sizes (sorted)
  int sliding_window = 0;           // the sliding layers' window (keys), 0 without such layers
  // Models with recurrent layers (Gated DeltaNet): each running request holds one of
  // max_num_seqs state slots, taken when it is admitted and given back when it stops running.
  bool state_slots = false;
};

struct SchedulerStats {
  uint64_t preemptions = 0, prefix_hit_tokens = 0, prefix_queried_tokens = 0,
           chunked_prefills = 0, padded_tokens = 0, steps = 0;
  uint64_t window_blocks_freed = 0;  // sliding-window blocks released while their request ran
};

class Scheduler {
 public:
  // window_pool / window_scratch: the sliding layers' pool and scratch block (cfg.sliding_window
  // > 0 only).
  Scheduler(SchedulerConfig cfg, KvPool* pool, int scratch_block, KvPool* window_pool = nullptr,
            int window_scratch = 0);

  void add(Request* r);
  // Drops a request from the queues and releases its blocks.
  void remove(Request* r);
  // Preempts every running request (KV released, recomputed when scheduled again, earliest
  // arrival first); returns how many.
  int retract_all();
  // Plans the next step into `plan` (cleared first; its capacity is reused); no tokens when
  // there is nothing to run.
  void schedule(StepPlan& plan, uint64_t iter, uint64_t weight_version);
  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  const SchedulerStats& stats() const { return stats_; }
  const SchedulerConfig& config() const { return cfg_; }
  int num_running() const { return int(running_.size()); }
  int num_waiting() const { return int(waiting_.size()); }
  // Tokens still to be produced would exceed max_tokens: nothing more to schedule.
  static bool done_scheduling(const Request& r);

 private:
  // Allocate blocks to hold upto_tokens, after releasing the sliding-window blocks no query from
  // r->num_computed on reads.
  bool grow_blocks(Request* r, int upto_tokens);
  void preempt(Request* r);
  void release_blocks(Request* r);
  void admit_prefix(Request* r);
  void plan_seq(StepPlan& plan, Request* r, int n);

  SchedulerConfig cfg_;
  KvPool* pool_;
  int scratch_block_;
  KvPool* window_pool_;
  int window_scratch_;
  WaitingQueue waiting_;
  std::vector<Request*> running_;
  std::vector<Request*> order_;  // scratch of schedule()
  uint64_t weight_version_ = 0;  // of the step being scheduled: the root of prefix hash chains
  SchedulerStats stats_;
  std::vector<int> free_slots_;  // state slots no running request holds (cfg_.state_slots)
};

}  // namespace r3
