#include "step/step_wire.h"

#include <cstring>
#include <type_traits>

#include "core/error.h"

namespace r3 {

namespace {

static_assert(std::is_trivially_copyable_v<PlannedSeq> &&
              std::is_trivially_copyable_v<PlannedToken> &&
              std::is_trivially_copyable_v<ScoreTarget>);

struct Header {
  uint64_t iter, weight_version;
  int32_t num_padding, any_routes;
  uint64_t seqs, tokens, block_tables, window_tables, hit_generations, scores;
};

template <typename T>
void put(std::vector<uint8_t>& bytes, const T* data, size_t n) {
  const size_t at = bytes.size();
  bytes.resize(at + n * sizeof(T));
  if (n) std::memcpy(bytes.data() + at, data, n * sizeof(T));
}

struct Reader {
  const std::vector<uint8_t>& bytes;
  size_t at = 0;
  template <typename T>
  void get(std::vector<T>& out, uint64_t n) {
    if (n > (bytes.size() - at) / sizeof(T)) throw Error("step message: truncated");
    out.resize(size_t(n));
    if (n) std::memcpy(out.data(), bytes.data() + at, size_t(n) * sizeof(T));
    at += size_t(n) * sizeof(T);
  }
};

}  // namespace

void write_step(const StepPlan& plan, const int* token_ids, std::vector<uint8_t>& bytes) {
  const Header h{plan.iter,
                 plan.weight_version,
                 int32_t(plan.num_padding),
                 int32_t(plan.any_routes),
                 plan.seqs.size(),
                 plan.tokens.size(),
                 plan.block_tables.size(),
                 plan.window_tables.size(),
                 plan.hit_generations.size(),
                 plan.scores.size()};
  bytes.clear();
  put(bytes, &h, 1);
  put(bytes, plan.seqs.data(), plan.seqs.size());
  put(bytes, plan.tokens.data(), plan.tokens.size());
  put(bytes, plan.block_tables.data(), plan.block_tables.size());
  put(bytes, plan.window_tables.data(), plan.window_tables.size());
  put(bytes, plan.hit_generations.data(), plan.hit_generations.size());
  put(bytes, plan.scores.data(), plan.scores.size());
  put(bytes, token_ids, plan.tokens.size());
}

void read_step(const std::vector<uint8_t>& bytes, StepPlan& plan, std::vector<int>& token_ids) {
  if (bytes.size() < sizeof(Header)) throw Error("step message: truncated");
  Header h;
  std::memcpy(&h, bytes.data(), sizeof h);
  Reader r{bytes, sizeof h};
  plan.iter = h.iter;
  plan.weight_version = h.weight_version;
  plan.num_padding = h.num_padding;
  plan.any_routes = h.any_routes != 0;
  r.get(plan.seqs, h.seqs);
  r.get(plan.tokens, h.tokens);
  r.get(plan.block_tables, h.block_tables);
  r.get(plan.window_tables, h.window_tables);
  r.get(plan.hit_generations, h.hit_generations);
  r.get(plan.scores, h.scores);
  r.get(token_ids, h.tokens);
  if (r.at != bytes.size())
    throw Error("step message: " + std::to_string(bytes.size() - r.at) + " trailing bytes");
}

}  // namespace r3
