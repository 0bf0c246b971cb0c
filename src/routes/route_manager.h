// C5: commits each step's captured routes, strictly in iter order, from the step's snapshot.
//  - PerRequestRouteStore: authoritative, one row per absolute position, overwritten
//    idempotently on recompute (preemption).
//  Each row's gate weights (float32, the ids' layout) go beside its ids: always in the shared
//  cache (a later request may ask for a prefix's weights), in a request's store when it asked.
//  - SharedRouteCache: one row per (block, offset), stamped with the block generation it was
//    written under; read only while the stamp equals the generation of the block a request
//    holds, so a reused block never yields its older content's routes.
// A prefix hit's rows are copied from the shared cache at the commit of the request's first step.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "routes/route_array.h"
#include "routes/route_capturer.h"
#include "step/step_plan.h"

namespace r3 {

struct RouteStats {
  uint64_t commits = 0, rows_committed = 0, prefix_rows_copied = 0, stale_prefix_rows = 0, gaps = 0,
           route_bytes_returned = 0;
};

class RouteManager {
 public:
  RouteManager(int num_moe_layers, int top_k, int num_blocks, int block_size);

  // A request that asked for routes; rows for positions [0, max_positions), with their gate
  // weights when with_weights.
  void open(uint64_t request_id, int max_positions, bool with_weights = false);
  void close(uint64_t request_id);
  bool is_open(uint64_t request_id) const { return stores_.count(request_id) > 0; }

  // Throws r3::Error if plans arrive out of iter order.
  void commit(const StepPlan& plan, const CaptureSlot& slot);

  // Speculative decoding: the rows of plan.seqs[seq]'s tokens from position `from` on were
  // computed for drafts that were rejected: they are forgotten (the request's store marks them
  // unwritten, the shared cache's stamps are cleared) as if never computed.
  void discard(const StepPlan& plan, size_t seq, int from);
  // Rows [start, seq_len - 1). Missing rows stay -1 and are counted in gaps (returned in *gaps).
  RouteArray assemble(uint64_t request_id, int seq_len, int start, uint64_t* gaps);
  // Rows [start, n) where n is the first position from scan_from on never written (aborted
  // requests; a streamed request's new rows, scanned from where the last ones ended); empty when
  // the request stopped before reaching start.
  RouteArray assemble_computed(uint64_t request_id, int seq_len, int start, int scan_from = 0);
  // (Both carry the rows' weights when the request's store holds them.)
  // Refit with a prefix-cache flush: no cached route survives.
  void invalidate_all();

  const RouteStats& stats() const { return stats_; }
  RouteStats& mutable_stats() { return stats_; }
  int row_size() const { return layers_ * k_; }
  // Bytes of the shared cache (ids, weights and stamps), for the memory report.
  size_t cache_bytes() const {
    return cache_.size() * sizeof(int16_t) + cache_weights_.size() * sizeof(float) +
           stamps_.size() * sizeof(uint64_t);
  }

 private:
  struct Store {
    std::vector<int16_t> rows;   // [max_positions, L, K]
    std::vector<float> weights;  // [max_positions, L, K], or empty (not asked for)
    std::vector<uint8_t> written;
  };
  int layers_, k_, num_blocks_, block_size_;
  std::unordered_map<uint64_t, Store> stores_;
  std::vector<int16_t> cache_;        // [num_blocks * block_size, L, K]
  std::vector<float> cache_weights_;  // [num_blocks * block_size, L, K]
  std::vector<uint64_t> stamps_;      // generation each cache row was written under (0 = never)
  std::vector<Store*> seq_store_;     // scratch of commit()
  uint64_t next_iter_ = 0;
  bool started_ = false;
  RouteStats stats_;
};

}  // namespace r3
