// Continuous batching with chunked prefill, prefix caching and preemption by recompute.
// Each step gets a token budget (max_num_batched_tokens) and at most max_num_seqs requests;
// running decodes go first, then running prefills, then waiting requests in arrival order
// (preempted ones at the front, so nobody starves). When blocks run out, the most recently
// arrived running request is preempted: its blocks are released (cached full blocks keep their
// hash, so it reuses them on resume) and it recomputes later.
#pragma once
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "engine/kv_pool.h"
#include "engine/request.h"
#include "step/step_plan.h"

namespace r3 {

struct SchedulerConfig {
  int max_num_seqs = 32;
  int max_num_batched_tokens = 512;
  bool enable_prefix_caching = true;
  std::vector<int> decode_buckets;  // pad pure-decode steps to these sizes (sorted)
};

struct SchedulerStats {
  uint64_t preemptions = 0, prefix_hit_tokens = 0, prefix_queried_tokens = 0,
           chunked_prefills = 0, padded_tokens = 0, steps = 0;
};

class Scheduler {
 public:
  Scheduler(SchedulerConfig cfg, KvPool* pool, int scratch_block);

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
  bool grow_blocks(Request* r, int upto_tokens);  // allocate blocks to hold upto_tokens
  void preempt(Request* r);
  void release_blocks(Request* r);
  void admit_prefix(Request* r);
  void plan_seq(StepPlan& plan, Request* r, int n);

  SchedulerConfig cfg_;
  KvPool* pool_;
  int scratch_block_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  std::vector<Request*> order_;  // scratch of schedule()
  SchedulerStats stats_;
};

}  // namespace r3
