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
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <vector>

#include "engine/kv_pool.h"
#include "engine/ngram_drafter.h"
#include "engine/request.h"
#include "engine/state_snapshots.h"
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
  // With prefix caching, a hit must end where a snapshot of that state was taken (the
  // Scheduler's `snapshots`): each step a request reaches a block boundary, the state at the
  // last one it reaches is snapshotted (in its prompt: every chunk's; past it: only the latest
  // is kept), and a hit is cut back to the longest prefix whose end has one.
  bool state_slots = false;
  // Speculative decoding (NGRAM): up to this many drafted tokens ride along with a decoding
  // request's token (0: off), while at most speculative_max_batch requests decode in the step.
  int num_draft_tokens = 0;
  int speculative_max_batch = 0;
  NgramDraftConfig ngram;
};

// A speculative drafter: up to max_drafts tokens proposed to follow r's tokens, into `out`
// (cleared first). Drafts change speed only: verification keeps the output without them.
using Drafter = std::function<void(const Request& r, int max_drafts, std::vector<int>& out)>;

struct SchedulerStats {
  uint64_t preemptions = 0, prefix_hit_tokens = 0, prefix_queried_tokens = 0, chunked_prefills = 0,
           padded_tokens = 0, steps = 0;
  uint64_t window_blocks_freed = 0;    // sliding-window blocks released while their request ran
  uint64_t snapshot_restores = 0;      // prefix hits that restored a recurrent-state snapshot
  uint64_t snapshot_cut_tokens = 0;    // hit tokens given up because no snapshot ended there
  uint64_t speculative_steps_off = 0;  // steps that drafted nothing: too many decoding at once
};

class Scheduler {
 public:
  // window_pool / window_scratch: the sliding layers' pool and scratch block (cfg.sliding_window
  // > 0 only). snapshots: the recurrent-state snapshots of prefix caching (cfg.state_slots with
  // prefix caching only; null: hybrids get no prefix hits).
  Scheduler(SchedulerConfig cfg, KvPool* pool, int scratch_block, KvPool* window_pool = nullptr,
            int window_scratch = 0, StateSnapshots* snapshots = nullptr);

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
  // Replaces the n-gram drafter (Engine::set_drafter).
  void set_drafter(Drafter d) { drafter_ = std::move(d); }
  // Speculative decoding: of the drafts `s` planned for r, `accepted` stood; the KV past them
  // is stale (the next step's tokens overwrite it before any query reads it). r's next draft
  // takes at most accepted + 1 tokens (Request::draft_budget).
  void reject_drafts(Request* r, const PlannedSeq& s, int accepted);

 private:
  // Allocate blocks to hold upto_tokens, after releasing the sliding-window blocks no query from
  // r->num_computed on reads.
  bool grow_blocks(Request* r, int upto_tokens);
  void preempt(Request* r);
  void release_blocks(Request* r);
  void admit_prefix(Request* r);
  // n tokens of r, the last `drafts` of them draft_ (speculative decoding).
  void plan_seq(StepPlan& plan, Request* r, int n, int drafts = 0);
  // Drafts r's next tokens into draft_ (at most max_drafts); returns how many.
  int draft(const Request& r, int max_drafts);
  // The snapshots `plan` (its previous contents) restored from or wrote: unpinned (that plan's
  // step is done; its writes were published when it was processed).
  void unpin_snapshots(const StepPlan& plan);
  void plan_snapshot(PlannedSeq& s, Request* r);

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
  StateSnapshots* snapshots_;
  std::vector<int> draft_, draft_context_;  // scratch of draft()
  Drafter drafter_;                         // set_drafter's, else the n-gram drafter
};

}  // namespace r3
