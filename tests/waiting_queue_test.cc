// The scheduler's waiting queue (issue 48: fairness behind huge submissions, linear cost in n):
// seeded random operations against a plain reference model of "FIFO within a group, groups take
// turns, a preempted request first"; and an engine where a small request submitted after 200
// others of one submission is served among the first, with outputs equal to its solo run.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine/waiting_queue.h"
#include "engine_test_util.h"
#include "test_models.h"

namespace r3 {
namespace {

// The reference: groups in turn order, each a deque of request ids.
struct Reference {
  std::deque<std::pair<uint64_t, std::deque<Request*>>> turns;
  std::deque<Request*>* find(uint64_t g) {
    for (auto& [group, q] : turns)
      if (group == g) return &q;
    return nullptr;
  }
  void push_back(Request* r) {
    if (auto* q = find(r->group))
      q->push_back(r);
    else
      turns.push_back({r->group, {r}});
  }
  void push_front(Request* r) {
    auto it =
        std::find_if(turns.begin(), turns.end(), [&](auto& t) { return t.first == r->group; });
    if (it == turns.end()) {
      turns.push_front({r->group, {r}});
      return;
    }
    auto moved = *it;
    turns.erase(it);
    moved.second.push_front(r);
    turns.push_front(moved);
  }
  Request* front() { return turns.front().second.front(); }
  void pop_front() {
    auto t = turns.front();
    turns.pop_front();
    t.second.pop_front();
    if (!t.second.empty()) turns.push_back(t);
  }
  void remove(Request* r) {
    for (auto it = turns.begin(); it != turns.end(); ++it)
      if (it->first == r->group) {
        it->second.erase(std::find(it->second.begin(), it->second.end(), r));
        if (it->second.empty()) turns.erase(it);
        return;
      }
  }
  size_t size() const {
    size_t n = 0;
    for (auto& t : turns) n += t.second.size();
    return n;
  }
};

TEST(WaitingQueue, MatchesTheReferenceUnderRandomOperations) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    std::mt19937 rng(seed);
    WaitingQueue q;
    Reference ref;
    std::vector<std::unique_ptr<Request>> all;
    std::vector<Request*> waiting;
    for (int op = 0; op < 3000; ++op) {
      const int kind = int(rng() % 10);
      if (kind < 5 || waiting.empty()) {  // add, to one of 4 groups or a group of its own
        all.push_back(std::make_unique<Request>());
        Request* r = all.back().get();
        r->id = all.size();
        r->group = rng() % 2 ? rng() % 4 : 1000 + r->id;
        const bool preempted = rng() % 8 == 0;
        if (preempted)
          q.push_front(r), ref.push_front(r);
        else
          q.push_back(r), ref.push_back(r);
        waiting.push_back(r);
      } else if (kind < 8) {  // admit the front
        ASSERT_EQ(q.front(), ref.front()) << "seed " << seed << " op " << op;
        Request* r = q.front();
        q.pop_front();
        ref.pop_front();
        EXPECT_FALSE(r->in_waiting);
        waiting.erase(std::find(waiting.begin(), waiting.end(), r));
      } else {  // finish or abort one anywhere
        const size_t i = rng() % waiting.size();
        q.remove(waiting[i]);
        ref.remove(waiting[i]);
        waiting.erase(waiting.begin() + long(i));
      }
      ASSERT_EQ(q.size(), ref.size());
      if (!q.empty()) {
        ASSERT_EQ(q.front(), ref.front()) << "seed " << seed << " op " << op;
      }
    }
  }
}

TEST(WaitingQueue, ASmallRequestIsNotQueuedBehindAHugeSubmission) {
  EngineConfig c = testing::small_config(testing::test_model("olmoe"));
  c.max_num_seqs = 2;
  Engine e(c);
  std::vector<uint64_t> big;
  for (int i = 0; i < 200; ++i)
    big.push_back(e.add_request({3, 4, 5, i % 40 + 6}, testing::greedy(3), 1));
  const uint64_t small = e.add_request({3, 9, 5}, testing::greedy(3));
  size_t big_done_before = 0;
  std::optional<RequestOutput> got;
  while (!got) {
    for (RequestOutput& o : e.step())
      if (o.finished) {
        if (o.request_id == small)
          got = std::move(o);
        else
          ++big_done_before;
      }
  }
  EXPECT_LE(big_done_before, 4u);  // FIFO would have served all 200 first
  Engine solo(testing::solo_config(testing::test_model("olmoe")));
  EXPECT_EQ(got->token_ids, solo.generate({{3, 9, 5}}, {testing::greedy(3)})[0].token_ids);
  while (e.has_unfinished()) e.step();
}

}  // namespace
}  // namespace r3
