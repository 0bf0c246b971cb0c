#include "engine/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace r3 {

Scheduler::Scheduler(SchedulerConfig cfg, KvPool* pool, int scratch_block, KvPool* window_pool,
                     int window_scratch, StateSnapshots* snapshots)
    : cfg_(std::move(cfg)),
      pool_(pool),
      scratch_block_(scratch_block),
      window_pool_(window_pool),
      window_scratch_(window_scratch),
      snapshots_(snapshots) {
  if (snapshots_ && !cfg_.state_slots)
    throw Error("scheduler: state snapshots need recurrent state slots");
  if (cfg_.state_slots && window_pool_)  // a hit would have to end where both are cached
    throw Error("scheduler: recurrent layers beside sliding-window layers are not implemented");
  std::sort(cfg_.decode_buckets.begin(), cfg_.decode_buckets.end());
  if ((cfg_.sliding_window > 0) != (window_pool_ != nullptr))
    throw Error("scheduler: a sliding window needs its own KV pool, and only then");
  if (window_pool_ && window_pool_->block_size() != pool_->block_size())
    throw Error("scheduler: the sliding-window pool must have the main pool's block size");
  if (cfg_.state_slots)
    for (int i = cfg_.max_num_seqs - 1; i >= 0; --i) free_slots_.push_back(i);
}

void Scheduler::add(Request* r) { waiting_.push_back(r); }

void Scheduler::release_blocks(Request* r) {
  // Release in reverse so the LRU free list evicts a sequence's tail blocks first.
  for (auto it = r->blocks.rbegin(); it != r->blocks.rend(); ++it) pool_->release(*it);
  r->blocks.clear();
  for (auto it = r->window_blocks.rbegin(); it != r->window_blocks.rend(); ++it)
    if (*it >= 0) window_pool_->release(*it);
  r->window_blocks.clear();
  r->window_freed = 0;
  if (r->state_slot >= 0) free_slots_.push_back(r->state_slot), r->state_slot = -1;
  r->restore_snapshot = -1;  // found for a hit these blocks were; not pinned before it is planned
}

void Scheduler::remove(Request* r) {
  if (r->in_waiting) {
    waiting_.remove(r);
  } else {
    running_.erase(std::remove(running_.begin(), running_.end(), r), running_.end());
  }
  release_blocks(r);
}

bool Scheduler::done_scheduling(const Request& r) {
  if (r.params.max_tokens == 0) return r.num_computed >= int(r.prompt.size());  // prompt only
  return int(r.output.size()) + r.pending >= r.params.max_tokens;
}

int Scheduler::retract_all() {
  // Latest arrival first: each goes to the front of the waiting queue, so the earliest ends first.
  std::vector<Request*> running = running_;
  std::sort(running.begin(), running.end(),
            [](Request* a, Request* b) { return a->arrival > b->arrival; });
  for (Request* r : running) preempt(r);
  return int(running.size());
}

int Scheduler::draft(const Request& r, int max_drafts) {
  if (drafter_) {
    drafter_(r, max_drafts, draft_);
    if (int(draft_.size()) > max_drafts) draft_.resize(size_t(max_drafts));
    return int(draft_.size());
  }
  // The tail the drafter may look at, contiguous (prompt and output are two vectors).
  const int n = r.num_tokens(),
            from = std::max(0, n - cfg_.ngram.max_lookback - cfg_.ngram.max_window);
  draft_context_.resize(size_t(n - from));
  for (int i = from; i < n; ++i) draft_context_[size_t(i - from)] = r.token(i);
  ngram_draft(draft_context_.data(), n - from, cfg_.ngram, max_drafts, draft_);
  return int(draft_.size());
}

void Scheduler::reject_drafts(Request* r, const PlannedSeq& s, int accepted) {
  r->num_computed = s.start_pos + s.num_tokens - s.num_drafts + accepted;
  r->draft_budget = accepted + 1;
}

void Scheduler::preempt(Request* r) {
  running_.erase(std::remove(running_.begin(), running_.end(), r), running_.end());
  release_blocks(r);
  r->block_hashes.clear();
  r->num_computed = 0;
  r->pending = 0;  // in-flight samples for it are discarded (epoch changes)
  ++r->epoch;
  ++r->num_preemptions;
  r->status = RequestStatus::Waiting;
  waiting_.push_front(r);
  ++stats_.preemptions;
}

bool Scheduler::grow_blocks(Request* r, int upto_tokens) {
  const int bs = pool_->block_size();
  const int need = (upto_tokens + bs - 1) / bs;
  if (window_pool_) {
    // Queries from num_computed on read keys from num_computed - window + 1 on (attention.h).
    const int first_key = r->num_computed - cfg_.sliding_window + 1;
    for (;
         r->window_freed < int(r->window_blocks.size()) && (r->window_freed + 1) * bs <= first_key;
         ++r->window_freed) {
      int& b = r->window_blocks[size_t(r->window_freed)];
      if (b >= 0) window_pool_->release(b), ++stats_.window_blocks_freed;
      b = -1;
    }
    while (int(r->window_blocks.size()) < need) {
      const int b = window_pool_->allocate();
      if (b < 0) return false;
      r->window_blocks.push_back(b);
    }
  }
  while (int(r->blocks.size()) < need) {
    int b = pool_->allocate();
    if (b < 0) return false;
    r->blocks.push_back(b);
  }
  return true;
}

void Scheduler::admit_prefix(Request* r) {
  r->prefix_hit_tokens = 0;
  r->hit_generations.clear();
  r->first_step_done = false;
  // Scored prompt tokens need their logits, which a prefix hit would skip.
  if (!cfg_.enable_prefix_caching || r->params.prompt_logprobs_start >= 0) return;
  std::vector<int> toks(size_t(r->num_tokens()));
  for (int i = 0; i < r->num_tokens(); ++i) toks[size_t(i)] = r->token(i);
  const uint64_t root = KvPool::chain_root(weight_version_);
  std::vector<int> hit = pool_->lookup_prefix(toks, root);
  stats_.prefix_queried_tokens += uint64_t(r->num_tokens());
  const int bs = pool_->block_size();
  std::vector<uint64_t> hashes;
  for (size_t i = 0; i < hit.size(); ++i)
    hashes.push_back(
        KvPool::chain_hash(i ? hashes.back() : root, toks.data() + i * size_t(bs), bs));
  // The sliding layers need their blocks of the window before the first token to compute: the
  // hit is cut back to where they are all cached.
  std::vector<int> window(hit.size(), -1);
  while (window_pool_ && !hit.empty()) {
    const int n = int(hit.size()), first_key = std::max(0, n * bs - cfg_.sliding_window + 1);
    bool cached = true;
    for (int b = first_key / bs; b < n && cached; ++b)
      cached = (window[size_t(b)] =
                    window_pool_->find(hashes[size_t(b)], toks.data() + size_t(b) * bs)) >= 0;
    if (cached) break;
    hit.pop_back();
    window.assign(hit.size(), -1);
  }
  // A recurrent model resumes from the state at the hit's end: the hit is cut back to the longest
  // prefix whose end has a snapshot (none without snapshots).
  if (cfg_.state_slots) {
    const size_t found = hit.size();
    while (!hit.empty() &&
           (!snapshots_ || (r->restore_snapshot = snapshots_->find(hashes[hit.size() - 1])) < 0))
      hit.pop_back();
    stats_.snapshot_cut_tokens += uint64_t(found - hit.size()) * uint64_t(bs);
  }
  for (size_t i = 0; i < hit.size(); ++i) {
    pool_->acquire(hit[i]);
    r->blocks.push_back(hit[i]);
    r->hit_generations.push_back(pool_->generation(hit[i]));
    r->block_hashes.push_back(hashes[i]);
    if (window_pool_) {
      if (window[i] >= 0) window_pool_->acquire(window[i]);
      r->window_blocks.push_back(window[i]);
      if (window[i] < 0 && r->window_freed == int(i)) ++r->window_freed;
    }
  }
  r->num_computed = int(hit.size()) * bs;
  r->prefix_hit_tokens = r->num_computed;
  stats_.prefix_hit_tokens += uint64_t(r->num_computed);
}

void Scheduler::plan_seq(StepPlan& plan, Request* r, int n, int drafts) {
  PlannedSeq s;
  s.request_id = r->id;
  s.epoch = r->epoch;
  s.first_token = int(plan.tokens.size());
  s.num_tokens = n;
  s.start_pos = r->num_computed;
  s.state_slot = r->state_slot;
  if (r->restore_snapshot >= 0) {
    s.snapshot_restore = r->restore_snapshot;
    snapshots_->pin(s.snapshot_restore);
    r->restore_snapshot = -1;
    ++stats_.snapshot_restores;  // counted once it is planned (an admission may still wait)
  }
  s.table_offset = int(plan.block_tables.size());
  s.table_len = int(r->blocks.size());
  plan.block_tables.insert(plan.block_tables.end(), r->blocks.begin(), r->blocks.end());
  if (window_pool_) {
    s.window_offset = int(plan.window_tables.size());
    plan.window_tables.insert(plan.window_tables.end(), r->window_blocks.begin(),
                              r->window_blocks.end());
  }
  s.sampler = r->params;
  s.wants_routes = r->params.return_routed_experts;
  if (!r->first_step_done) {
    s.prefix_hit_tokens = r->prefix_hit_tokens;
    s.hit_offset = int(plan.hit_generations.size());
    plan.hit_generations.insert(plan.hit_generations.end(), r->hit_generations.begin(),
                                r->hit_generations.end());
    r->first_step_done = true;
  }
  const int known = r->num_tokens();
  const int bs = pool_->block_size();
  for (int i = 0; i < n; ++i) {
    PlannedToken t;
    t.seq = int(plan.seqs.size());
    t.position = s.start_pos + i;
    t.token = t.position < known ? r->token(t.position)
              : i >= n - drafts  ? draft_[size_t(i - (n - drafts))]
                                 : -1;
    t.block = r->blocks[size_t(t.position / bs)];
    t.block_generation = pool_->generation(t.block);
    t.slot = t.position % bs;
    if (window_pool_) t.window_block = r->window_blocks[size_t(t.position / bs)];
    plan.tokens.push_back(t);
  }
  s.first_token_pending = plan.tokens[size_t(s.first_token)].token < 0;
  if (r->params.prompt_logprobs_start >= 0) {
    const int P = int(r->prompt.size()), from = std::max(r->params.prompt_logprobs_start, 1);
    s.score_offset = int(plan.scores.size());
    for (int i = 0; i < n; ++i) {
      const int p = s.start_pos + i + 1;  // this token's logits predict position p
      if (p >= from && p < P)
        plan.scores.push_back({int(plan.seqs.size()), s.first_token + i, r->prompt[size_t(p)], p});
    }
    s.score_count = int(plan.scores.size()) - s.score_offset;
  }
  if (snapshots_) plan_snapshot(s, r);
  r->num_computed += n;
  if (drafts > 0) {
    // Verification: the KV of every draft is written now and rolled back past the last one
    // accepted once the step is computed (reject_drafts).
    s.num_drafts = drafts;
    s.sample = true;
    ++r->pending;
  } else if (r->num_computed == known + r->pending && r->params.max_tokens > 0) {
    s.sample = true;
    ++r->pending;
  } else if (r->num_computed < known + r->pending) {
    ++stats_.chunked_prefills;
  }
  plan.any_routes |= s.wants_routes;
  plan.seqs.push_back(s);
}

// The state after the last block boundary this step reaches, if it reaches one, unless its KV
// cannot be published (computed under older weights: Engine::publish_full_blocks). In the
// prompt every chunk's is kept (a shared prompt is hit at its end); past it, each replaces the
// request's previous one, so a decode leaves one snapshot, near its end, for the next turn.
void Scheduler::plan_snapshot(PlannedSeq& s, Request* r) {
  const int bs = pool_->block_size(), boundary = (s.start_pos + s.num_tokens) / bs * bs;
  if (boundary <= s.start_pos || r->kv_version != weight_version_) return;
  const int slot = snapshots_->reserve();
  if (slot < 0) return;  // every slot in use by plans in flight: no snapshot this time
  s.snapshot_write = slot;
  s.snapshot_tokens = boundary - s.start_pos;
  if (boundary <= int(r->prompt.size())) return;
  if (r->trail_snapshot >= 0) snapshots_->drop(r->trail_snapshot, r->trail_generation);
  r->trail_snapshot = slot;
  r->trail_generation = snapshots_->generation(slot);
}

void Scheduler::unpin_snapshots(const StepPlan& plan) {
  for (const PlannedSeq& s : plan.seqs) {
    if (s.snapshot_restore >= 0) snapshots_->unpin(s.snapshot_restore);
    if (s.snapshot_write >= 0) snapshots_->unpin(s.snapshot_write);
  }
}

void Scheduler::schedule(StepPlan& plan, uint64_t iter, uint64_t weight_version) {
  weight_version_ = weight_version;
  if (snapshots_) unpin_snapshots(plan);
  plan.clear();
  plan.iter = iter;
  plan.weight_version = weight_version;
  int budget = cfg_.max_num_batched_tokens;

  // Running requests: decodes first, then prefills; each group in arrival order.
  order_ = running_;
  std::vector<Request*>& order = order_;
  std::stable_sort(order.begin(), order.end(), [](Request* a, Request* b) {
    if (a->is_decode() != b->is_decode()) return a->is_decode();
    return a->arrival < b->arrival;
  });
  // Speculative decoding drafts only while few requests decode: beyond that a step reads the
  // weights for enough tokens already, and verifying drafts costs more than it saves.
  bool speculate = cfg_.num_draft_tokens > 0;
  if (speculate) {
    int decoding = 0;
    for (Request* r : order) decoding += r->is_decode() && !done_scheduling(*r);
    speculate = decoding <= cfg_.speculative_max_batch;
    stats_.speculative_steps_off += !speculate && decoding > 0;
  }
  int drafting = 0;
  for (Request* r : order) {
    if (r->status != RequestStatus::Running) continue;  // preempted in this loop
    if (budget <= 0) break;
    if (done_scheduling(*r)) continue;
    const int total = r->num_tokens() + r->pending;
    int n = std::min(total - r->num_computed, budget);
    if (n <= 0) continue;
    // A decode of a known token may take drafts along: at most one per token still to sample
    // after it (so no draft passes max_tokens or the positions add_request checked).
    if (speculate && n == 1 && r->pending == 0 && r->num_computed == r->num_tokens() - 1) {
      const int room = std::min({cfg_.num_draft_tokens, r->draft_budget, budget - 1,
                                 r->params.max_tokens - int(r->output.size()) - 1});
      if (const int d = draft(*r, room); d > 0 && grow_blocks(r, r->num_computed + 1 + d)) {
        plan_seq(plan, r, 1 + d, d);
        // A recurrent state is kept after each draft (ModelRunner::reserve_draft_states), one slot
        // per drafting request of the step: at most speculative_max_batch of them.
        if (cfg_.state_slots) plan.seqs.back().draft_slot = drafting++;
        budget -= 1 + d;
        continue;
      }
    }
    while (!grow_blocks(r, r->num_computed + n)) {
      // Out of blocks: preempt the latest arrival (possibly r itself).
      Request* victim =
          *std::max_element(running_.begin(), running_.end(),
                            [](Request* a, Request* b) { return a->arrival < b->arrival; });
      preempt(victim);
      if (victim == r) break;
    }
    if (r->status != RequestStatus::Running) continue;
    plan_seq(plan, r, n);
    budget -= n;
  }

  // Waiting requests, groups taking turns (WaitingQueue); stop at the first that does not fit
  // (no overtaking).
  while (!waiting_.empty() && budget > 0 && int(running_.size()) < cfg_.max_num_seqs) {
    Request* r = waiting_.front();
    if (r->blocks.empty()) admit_prefix(r);
    const int total = r->num_tokens();
    int n = std::min(total - r->num_computed, budget);
    if (!grow_blocks(r, r->num_computed + n)) {
      // Leave it waiting; keep nothing allocated so running requests can use the blocks.
      release_blocks(r);
      r->block_hashes.clear();
      r->num_computed = 0;
      break;
    }
    waiting_.pop_front();
    if (cfg_.state_slots) {  // at most max_num_seqs run, so one is free
      r->state_slot = free_slots_.back();
      free_slots_.pop_back();
    }
    r->status = RequestStatus::Running;
    r->kv_version = weight_version;
    running_.push_back(r);
    plan_seq(plan, r, n);
    budget -= n;
  }

  // Bucketed decode: pad pure-decode steps up to the next bucket with dummy tokens that
  // write only the scratch block and belong to no request.
  if (!cfg_.decode_buckets.empty() && !plan.tokens.empty() &&
      int(plan.tokens.size()) == int(plan.seqs.size())) {
    int want = int(plan.tokens.size());
    for (int b : cfg_.decode_buckets)
      if (b >= want) {
        want = b;
        break;
      }
    while (int(plan.tokens.size()) < want) {
      PlannedToken t;
      t.seq = -1;
      t.block = scratch_block_;
      t.window_block = window_scratch_;
      t.slot = int(plan.tokens.size()) % pool_->block_size();
      t.position = 0;
      t.token = 0;
      plan.tokens.push_back(t);
      ++plan.num_padding;
    }
    stats_.padded_tokens += uint64_t(plan.num_padding);
  }
  if (!plan.tokens.empty()) ++stats_.steps;
}

}  // namespace r3
