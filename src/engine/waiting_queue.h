// The scheduler's waiting requests. FIFO within a group (the requests of one submission: a
// /generate batch, the n samples of one call), and the groups take turns, so a submission of
// 65,536 prompts cannot make a later small request wait for all of them; a request alone in its
// group (the default) makes the whole queue plain FIFO. Every operation is O(1): finishing or
// aborting one of n waiting requests never scans the others.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <unordered_map>

#include "engine/request.h"

namespace r3 {

class WaitingQueue {
 public:
  // At the end of its group; a group new to the queue takes the last turn.
  void push_back(Request* r);
  // A preempted request: at its group's front, and its group's turn comes first.
  void push_front(Request* r);
  // The front request of the group whose turn it is (the queue must not be empty).
  Request* front() const;
  // Removes front(); its group's turn passes to the next group.
  void pop_front();
  // Removes a request wherever it waits (it must be waiting).
  void remove(Request* r);
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  struct Group {
    std::list<Request*> requests;
    std::list<uint64_t>::iterator turn;  // its place in turns_
  };
  void drop_if_empty(uint64_t group);

  std::unordered_map<uint64_t, Group> groups_;
  std::list<uint64_t> turns_;  // groups with waiting requests, the next turn first
  size_t size_ = 0;
};

}  // namespace r3
