#include "engine/ngram_drafter.h"

#include <algorithm>

namespace r3 {

void ngram_draft(const int* tokens, int n, const NgramDraftConfig& cfg, int max_drafts,
                 std::vector<int>& out) {
  out.clear();
  if (max_drafts <= 0) return;
  const int first = std::max(0, n - cfg.max_lookback);
  for (int w = std::min(cfg.max_window, n - 1); w >= std::max(cfg.min_window, 1); --w) {
    const int* tail = tokens + n - w;
    // The most recent earlier occurrence: it ends before the tail ends, and something follows it.
    for (int start = n - w - 1; start >= first; --start) {
      if (!std::equal(tail, tail + w, tokens + start)) continue;
      const int from = start + w, count = std::min(max_drafts, n - from);
      out.assign(tokens + from, tokens + from + count);
      return;
    }
  }
}

}  // namespace r3
