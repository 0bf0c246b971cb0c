// Which recurrent states a hybrid model (Gated DeltaNet layers) keeps for prefix caching, and
// under what key (metadata only; the states live in the ModelRunner). A DeltaNet layer's memory
// is one state per request, not per block, so a prefix hit must restore the state at the hit's
// end: a snapshot of a request's whole recurrent state (every DeltaNet layer: the S matrices and
// the conv windows) taken at a block boundary, keyed by the chained hash of the block that ends
// there (KvPool::chain_hash: the weight version and every token before the boundary). By batch
// invariance that state is a function of the key alone, however the tokens were scheduled.
//
// Lifetime of a slot: reserve() (a step will write it: pinned), publish() (the step succeeded:
// findable under its key), unpin() when the plan that used it is done (a step restoring from a
// slot pins it too). Unpinned slots are reused least recently used first, unpublished ones
// before any published one, so `capacity` bounds the memory. Pins keep a slot from being
// rewritten while a plan in flight still writes or reads it (the overlap scheduler plans step
// N + 1 while step N runs).
#pragma once
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace r3 {

class StateSnapshots {
 public:
  explicit StateSnapshots(int capacity);

  int capacity() const { return int(slots_.size()); }
  // A slot for a snapshot a step is about to write, pinned; its old key is forgotten. -1 when
  // every slot is pinned. generation(slot) changes with every reservation.
  int reserve();
  uint64_t generation(int slot) const { return slots_[size_t(slot)].generation; }
  // The published snapshot under `hash`, or -1 (a hit counts as a use for the LRU order).
  int find(uint64_t hash);
  void pin(int slot) { ++slots_[size_t(slot)].pins; }
  void unpin(int slot);
  // The step that wrote `slot` succeeded: findable under `hash` (first writer of a key wins).
  void publish(int slot, uint64_t hash);
  // Forgets the snapshot in `slot` if it still holds reservation `generation` and no plan uses
  // it (a request's superseded snapshot of its own output).
  void drop(int slot, uint64_t generation);
  // Forgets every key (weights changed, KV released): no later lookup can hit an old state.
  void flush();

  uint64_t published() const { return published_; }  // snapshots made findable, for stats
  int num_published() const { return int(by_hash_.size()); }

 private:
  struct Slot {
    bool published = false;
    uint64_t hash = 0, generation = 0, last_use = 0;
    int pins = 0;
  };
  void forget(int slot);

  std::vector<Slot> slots_;
  std::unordered_map<uint64_t, int> by_hash_;
  uint64_t clock_ = 0, published_ = 0;
};

}  // namespace r3
