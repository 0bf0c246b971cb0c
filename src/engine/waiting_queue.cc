#include "engine/waiting_queue.h"

namespace r3 {

void WaitingQueue::push_back(Request* r) {
  auto [it, fresh] = groups_.try_emplace(r->group);
  if (fresh) it->second.turn = turns_.insert(turns_.end(), r->group);
  r->waiting_at = it->second.requests.insert(it->second.requests.end(), r);
  r->in_waiting = true;
  ++size_;
}

void WaitingQueue::push_front(Request* r) {
  auto [it, fresh] = groups_.try_emplace(r->group);
  if (fresh)
    it->second.turn = turns_.insert(turns_.begin(), r->group);
  else
    turns_.splice(turns_.begin(), turns_, it->second.turn);
  r->waiting_at = it->second.requests.insert(it->second.requests.begin(), r);
  r->in_waiting = true;
  ++size_;
}

Request* WaitingQueue::front() const { return groups_.at(turns_.front()).requests.front(); }

void WaitingQueue::pop_front() {
  const uint64_t g = turns_.front();
  Group& group = groups_.at(g);
  group.requests.front()->in_waiting = false;
  group.requests.pop_front();
  --size_;
  if (group.requests.empty()) return drop_if_empty(g);
  turns_.splice(turns_.end(), turns_, group.turn);  // the next group's turn
}

void WaitingQueue::remove(Request* r) {
  Group& group = groups_.at(r->group);
  group.requests.erase(r->waiting_at);
  r->in_waiting = false;
  --size_;
  drop_if_empty(r->group);
}

void WaitingQueue::drop_if_empty(uint64_t g) {
  auto it = groups_.find(g);
  if (it == groups_.end() || !it->second.requests.empty()) return;
  turns_.erase(it->second.turn);
  groups_.erase(it);
}

}  // namespace r3
