// Bounds on one chat-template render. A template may come from a request (when the server
// trusts request templates) or from a downloaded model, so rendering one must not crash the
// process, pin a core or allocate without bound, whatever it says. Each render runs under a
// RenderBudget: a step budget (every expression and statement evaluated), a byte budget (every
// string byte and container slot produced, added up over the render, and charged before the
// allocation of anything a single operation could make large), a nesting depth at run time
// (macro calls included), a wall-clock deadline and a cancellation poll. Exceeding any of them
// is an r3::Error naming the template line. Nesting at parse time is bounded by the parser
// (kMaxTemplateNesting).
//
// The budget also owns the render's containers: lists, dicts and namespaces created while it is
// active are recorded, and emptied when the render ends, so reference cycles a template builds
// (a list appended to itself) are broken and deeply nested values are freed without recursion.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace r3::text::jinja {

struct Value;
struct Namespace;

struct RenderLimits {
  int64_t max_steps = 20'000'000;          // expressions and statements evaluated (~2 s of CPU)
  int64_t max_bytes = int64_t(128) << 20;  // string bytes and container slots produced, summed
  int max_depth = 256;                     // nested evaluations (statements, expressions, calls)
  double max_seconds = 10;                 // wall clock, checked with the cancellation poll
  std::function<bool()> cancelled;         // polled every 1024 steps: client gone, shutdown
};

// Parse-time bound on nesting: parentheses, brackets, `not`/unary chains, statement blocks and
// the depth of an expression's tree (a chain of 10^5 `+` would recurse when evaluated or freed).
inline constexpr int kMaxTemplateNesting = 100;
// Values nested deeper than this are refused when printed, compared or written as JSON.
inline constexpr int kMaxValueDepth = 256;

class RenderBudget {
 public:
  // Becomes this thread's active budget until destroyed (renders do not nest).
  explicit RenderBudget(const RenderLimits& limits);
  ~RenderBudget();
  RenderBudget(const RenderBudget&) = delete;
  RenderBudget& operator=(const RenderBudget&) = delete;

  // The render running on this thread, or nullptr: outside a render the charges are free.
  static RenderBudget* active();

  // One evaluation at template line `line` (kept for the messages of later charges).
  void step(int line);
  // `n` more steps of work inside one evaluation (items compared, searched or copied).
  void work(uint64_t n);
  // `bytes` about to be produced; throws before the caller allocates them.
  void produce(uint64_t bytes);
  // Entering a nested evaluation; leave() when done (use DepthGuard).
  void enter();
  void leave() { --depth_; }
  int line() const { return line_; }
  // Throws r3::Error("chat template line N: what") at the line of the latest step.
  [[noreturn]] void exceeded(const std::string& what) const;

  // Records a container created during the render (see the class comment).
  void adopt(const std::shared_ptr<std::vector<Value>>& list);
  void adopt(const std::shared_ptr<std::vector<std::pair<std::string, Value>>>& dict);
  void adopt(const std::shared_ptr<Namespace>& ns);
  // Records a container whose bytes were charged before it was built (from_json charges a JSON
  // array's or object's slots before allocating them, so the peak never passes the budget).
  // (Out of line: Value is incomplete here, which clang refuses for the vectors' growth.)
  void own(const std::shared_ptr<std::vector<Value>>& list);
  void own(const std::shared_ptr<std::vector<std::pair<std::string, Value>>>& dict);

 private:
  RenderLimits limits_;
  std::chrono::steady_clock::time_point deadline_;
  int64_t steps_ = 0, bytes_ = 0;
  int depth_ = 0, line_ = 0;
  std::vector<std::shared_ptr<std::vector<Value>>> lists_;
  std::vector<std::shared_ptr<std::vector<std::pair<std::string, Value>>>> dicts_;
  std::vector<std::shared_ptr<Namespace>> namespaces_;
  RenderBudget* previous_;
};

// Charges on the active budget, free outside a render.
void charge_bytes(uint64_t bytes);
void charge_work(uint64_t steps);

class DepthGuard {
 public:
  explicit DepthGuard(RenderBudget& b) : b_(b) { b_.enter(); }
  ~DepthGuard() { b_.leave(); }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  RenderBudget& b_;
};

}  // namespace r3::text::jinja
