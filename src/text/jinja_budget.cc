#include "text/jinja_budget.h"

#include "core/error.h"
#include "text/jinja_value.h"

namespace r3::text::jinja {

namespace {
thread_local RenderBudget* active_budget = nullptr;
constexpr int64_t kPollEvery = 1024;  // steps between deadline and cancellation checks
}  // namespace

RenderBudget::RenderBudget(const RenderLimits& limits)
    : limits_(limits),
      deadline_(std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(limits.max_seconds))),
      previous_(active_budget) {
  active_budget = this;
}

RenderBudget::~RenderBudget() {
  active_budget = previous_;
  // Empty every container first: what they hold is released while the records still hold each
  // container, so no release recurses and no cycle survives.
  for (auto& l : lists_) l->clear();
  for (auto& d : dicts_) d->clear();
  for (auto& n : namespaces_) n->attrs.clear();
}

RenderBudget* RenderBudget::active() { return active_budget; }

void RenderBudget::exceeded(const std::string& what) const {
  throw Error("chat template line " + std::to_string(line_) + ": " + what);
}

void RenderBudget::step(int line) {
  line_ = line;
  work(1);
}

void RenderBudget::work(uint64_t n) {
  const int64_t before = steps_;
  if (n > uint64_t(limits_.max_steps - steps_))
    steps_ = limits_.max_steps + 1;
  else
    steps_ += int64_t(n);
  if (steps_ > limits_.max_steps)
    exceeded("the template ran past its budget of " + std::to_string(limits_.max_steps) + " steps");
  if (steps_ / kPollEvery == before / kPollEvery) return;
  if (limits_.cancelled && limits_.cancelled()) exceeded("rendering was cancelled");
  if (std::chrono::steady_clock::now() > deadline_)
    exceeded("the template ran past its time budget of " + std::to_string(limits_.max_seconds) +
             " s");
}

void RenderBudget::produce(uint64_t bytes) {
  if (bytes > uint64_t(limits_.max_bytes - bytes_))
    exceeded("the template produced more than its budget of " + std::to_string(limits_.max_bytes) +
             " bytes of values");
  bytes_ += int64_t(bytes);
}

void RenderBudget::enter() {
  if (++depth_ > limits_.max_depth) {
    --depth_;
    exceeded("the template nests evaluations (macro calls, blocks, expressions) deeper than " +
             std::to_string(limits_.max_depth));
  }
}

void RenderBudget::adopt(const std::shared_ptr<std::vector<Value>>& list) {
  produce(sizeof(list) + list->size() * sizeof(Value));
  lists_.push_back(list);
}

void RenderBudget::adopt(const std::shared_ptr<std::vector<std::pair<std::string, Value>>>& dict) {
  produce(sizeof(dict) + dict->size() * sizeof(std::pair<std::string, Value>));
  dicts_.push_back(dict);
}

void RenderBudget::own(const std::shared_ptr<std::vector<Value>>& list) { lists_.push_back(list); }
void RenderBudget::own(const std::shared_ptr<std::vector<std::pair<std::string, Value>>>& dict) {
  dicts_.push_back(dict);
}

void RenderBudget::adopt(const std::shared_ptr<Namespace>& ns) {
  produce(sizeof(ns) + ns->attrs.size() * sizeof(std::pair<std::string, Value>));
  namespaces_.push_back(ns);
}

void charge_bytes(uint64_t bytes) {
  if (active_budget) active_budget->produce(bytes);
}

void charge_work(uint64_t steps) {
  if (active_budget) active_budget->work(steps);
}

}  // namespace r3::text::jinja
