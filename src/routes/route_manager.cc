#include "routes/route_manager.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace r3 {

RouteManager::RouteManager(int num_moe_layers, int top_k, int num_blocks, int block_size)
    : layers_(num_moe_layers), k_(top_k), num_blocks_(num_blocks), block_size_(block_size) {
  cache_.assign(size_t(num_blocks) * size_t(block_size) * size_t(row_size()), -1);
  cache_weights_.assign(cache_.size(), 0.f);
  stamps_.assign(size_t(num_blocks) * size_t(block_size), 0);
}

void RouteManager::open(uint64_t id, int max_positions, bool with_weights) {
  Store& s = stores_[id];
  s.rows.assign(size_t(max_positions) * size_t(row_size()), -1);
  s.weights.assign(with_weights ? s.rows.size() : 0, 0.f);
  s.written.assign(size_t(max_positions), 0);
}

void RouteManager::close(uint64_t id) { stores_.erase(id); }

void RouteManager::commit(const StepPlan& plan, const CaptureSlot& slot) {
  if (started_ && plan.iter != next_iter_)
    throw Error("route commit out of order: got iter " + std::to_string(plan.iter) + ", expected " +
                std::to_string(next_iter_));
  started_ = true;
  next_iter_ = plan.iter + 1;
  ++stats_.commits;
  const size_t rs = size_t(row_size());
  std::vector<Store*>& seq_store = seq_store_;
  seq_store.assign(plan.seqs.size(), nullptr);
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const PlannedSeq& s = plan.seqs[i];
    auto it = stores_.find(s.request_id);
    if (it == stores_.end()) continue;  // finished, aborted, or did not ask for routes
    Store* st = &it->second;
    seq_store[i] = st;
    // Prefix hit: rows of the hit tokens come from the shared cache, valid only under the
    // generation the block had when the request took it.
    for (int pos = 0; pos < s.prefix_hit_tokens; ++pos) {
      const int bi = pos / block_size_;
      const size_t c =
          size_t(plan.block_table(s)[bi]) * size_t(block_size_) + size_t(pos % block_size_);
      if (size_t(pos) >= st->written.size()) break;
      if (stamps_[c] != 0 && stamps_[c] == plan.hit_generation(s, bi)) {
        std::memcpy(st->rows.data() + size_t(pos) * rs, cache_.data() + c * rs,
                    rs * sizeof(int16_t));
        if (!st->weights.empty())
          std::memcpy(st->weights.data() + size_t(pos) * rs, cache_weights_.data() + c * rs,
                      rs * sizeof(float));
        st->written[size_t(pos)] = 1;
        ++stats_.prefix_rows_copied;
      } else {
        ++stats_.stale_prefix_rows;
      }
    }
  }
  for (size_t t = 0; t < plan.tokens.size(); ++t) {
    const PlannedToken& tok = plan.tokens[t];
    if (tok.seq < 0) continue;  // padding is never attributed
    const int16_t* row = slot.row(int(t));
    const size_t c = size_t(tok.block) * size_t(block_size_) + size_t(tok.slot);
    const float* weights = slot.weight_row(int(t));
    std::memcpy(cache_.data() + c * rs, row, rs * sizeof(int16_t));
    std::memcpy(cache_weights_.data() + c * rs, weights, rs * sizeof(float));
    stamps_[c] = tok.block_generation;
    if (Store* st = seq_store[size_t(tok.seq)]; st && size_t(tok.position) < st->written.size()) {
      std::memcpy(st->rows.data() + size_t(tok.position) * rs, row, rs * sizeof(int16_t));
      if (!st->weights.empty())
        std::memcpy(st->weights.data() + size_t(tok.position) * rs, weights, rs * sizeof(float));
      st->written[size_t(tok.position)] = 1;
      ++stats_.rows_committed;
    }
  }
}

void RouteManager::discard(const StepPlan& plan, size_t seq, int from) {
  const PlannedSeq& s = plan.seqs[seq];
  auto it = stores_.find(s.request_id);
  for (int t = s.first_token; t < s.first_token + s.num_tokens; ++t) {
    const PlannedToken& tok = plan.tokens[size_t(t)];
    if (tok.position < from) continue;
    stamps_[size_t(tok.block) * size_t(block_size_) + size_t(tok.slot)] = 0;
    if (it != stores_.end() && size_t(tok.position) < it->second.written.size())
      it->second.written[size_t(tok.position)] = 0;
  }
}

RouteArray RouteManager::assemble(uint64_t id, int seq_len, int start, uint64_t* gaps) {
  auto it = stores_.find(id);
  if (it == stores_.end()) throw Error("no route store for request " + std::to_string(id));
  const Store& st = it->second;
  const int rows = std::max(0, seq_len - 1 - start);
  RouteArray out(rows, layers_, k_);
  out.start = start;
  const size_t rs = size_t(row_size());
  if (!st.weights.empty()) out.weights.assign(out.data.size(), 0.f);
  uint64_t missing = 0;
  for (int r = 0; r < rows; ++r) {
    const size_t pos = size_t(start + r);
    if (pos < st.written.size() && st.written[pos]) {
      std::memcpy(out.row(r), st.rows.data() + pos * rs, rs * sizeof(int16_t));
      if (!st.weights.empty())
        std::memcpy(out.weights.data() + size_t(r) * rs, st.weights.data() + pos * rs,
                    rs * sizeof(float));
    } else {
      ++missing;
    }
  }
  stats_.gaps += missing;
  if (gaps) *gaps = missing;
  stats_.route_bytes_returned +=
      out.data.size() * sizeof(int16_t) + out.weights.size() * sizeof(float);
  return out;
}

RouteArray RouteManager::assemble_computed(uint64_t id, int seq_len, int start, int scan_from) {
  auto it = stores_.find(id);
  if (it == stores_.end()) throw Error("no route store for request " + std::to_string(id));
  const Store& st = it->second;
  int n = std::max(0, scan_from);
  while (n < seq_len - 1 && size_t(n) < st.written.size() && st.written[size_t(n)]) ++n;
  const int rows = std::max(0, n - start);
  RouteArray out(rows, layers_, k_);
  out.start = start;
  if (rows)
    std::memcpy(out.data.data(), st.rows.data() + size_t(start) * size_t(row_size()),
                out.data.size() * sizeof(int16_t));
  if (rows && !st.weights.empty()) {
    const auto first = st.weights.begin() + ptrdiff_t(size_t(start) * size_t(row_size()));
    out.weights.assign(first, first + ptrdiff_t(out.data.size()));
  }
  stats_.route_bytes_returned +=
      out.data.size() * sizeof(int16_t) + out.weights.size() * sizeof(float);
  return out;
}

void RouteManager::invalidate_all() { std::fill(stamps_.begin(), stamps_.end(), 0); }

}  // namespace r3
