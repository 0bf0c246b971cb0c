#include "engine/state_snapshots.h"

#include "core/error.h"

namespace r3 {

StateSnapshots::StateSnapshots(int capacity) : slots_(size_t(capacity)) {
  if (capacity < 0) throw Error("state snapshots: capacity must be >= 0");
  by_hash_.reserve(size_t(capacity));
}

void StateSnapshots::forget(int slot) {
  Slot& s = slots_[size_t(slot)];
  if (!s.published) return;
  auto it = by_hash_.find(s.hash);
  if (it != by_hash_.end() && it->second == slot) by_hash_.erase(it);
  s.published = false;
}

// A linear scan: capacity is a few times max_num_seqs and a step reserves at most one slot per
// request, so this stays far below the step's other per-request work.
int StateSnapshots::reserve() {
  int best = -1;
  for (int i = 0; i < capacity(); ++i) {
    const Slot& s = slots_[size_t(i)];
    if (s.pins > 0) continue;
    if (!s.published) {
      best = i;
      break;
    }  // free: no snapshot is lost
    if (best < 0 || s.last_use < slots_[size_t(best)].last_use) best = i;
  }
  if (best < 0) return -1;
  forget(best);
  Slot& s = slots_[size_t(best)];
  ++s.generation;
  s.pins = 1;
  s.last_use = ++clock_;
  return best;
}

int StateSnapshots::find(uint64_t hash) {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return -1;
  slots_[size_t(it->second)].last_use = ++clock_;
  return it->second;
}

void StateSnapshots::unpin(int slot) {
  Slot& s = slots_[size_t(slot)];
  if (s.pins <= 0) throw Error("state snapshots: unpin of an unpinned slot");
  --s.pins;
}

void StateSnapshots::publish(int slot, uint64_t hash) {
  Slot& s = slots_[size_t(slot)];
  if (s.published || by_hash_.count(hash)) return;
  s.published = true;
  s.hash = hash;
  s.last_use = ++clock_;
  by_hash_[hash] = slot;
  ++published_;
}

void StateSnapshots::drop(int slot, uint64_t generation) {
  Slot& s = slots_[size_t(slot)];
  if (s.generation != generation || s.pins > 0) return;
  forget(slot);
}

void StateSnapshots::flush() {
  for (int i = 0; i < capacity(); ++i) forget(i);
  by_hash_.clear();
}

}  // namespace r3
