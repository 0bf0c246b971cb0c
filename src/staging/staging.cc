// Trainer-side staging: per-call delta alignment (filler row + [prev_len:] slice), rollout
// assembly with turn-boundary repair (the NeMo-RL route envelope is routes/route_envelope.h).
#include "staging/staging.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace r3 {

namespace {

std::string call_prefix(int call_index, int T, int prev_len, int start) {
  std::ostringstream o;
  o << "stage_call: call " << call_index << " (T=" << T << ", prev_len=" << prev_len
    << ", start=" << start << "): ";
  return o.str();
}

// Checks one token's [L, K] block. Returns "" when the row is usable: either every id is a valid
// expert (in [0, num_experts), no duplicate within a layer) or the whole row is -1 (a genuinely
// missing route, which the trainer's router decides). Otherwise says what is wrong.
std::string check_row(const int16_t* row, int layers, int k, int num_experts, bool* all_minus_one) {
  int minus = 0;
  const int n = layers * k;
  for (int i = 0; i < n; ++i) minus += (row[i] == -1);
  if (all_minus_one) *all_minus_one = (n > 0 && minus == n);
  if (minus == n) return "";
  if (minus > 0) {
    std::ostringstream o;
    o << "row is partly -1 (" << minus << " of " << n << " ids are -1)";
    return o.str();
  }
  for (int l = 0; l < layers; ++l) {
    const int16_t* ids = row + size_t(l) * size_t(k);
    for (int j = 0; j < k; ++j) {
      if (ids[j] < 0 || ids[j] >= num_experts) {
        std::ostringstream o;
        o << "layer " << l << " has expert id " << ids[j] << " outside [0, " << num_experts << ")";
        return o.str();
      }
      for (int jj = 0; jj < j; ++jj) {
        if (ids[jj] == ids[j]) {
          std::ostringstream o;
          o << "layer " << l << " repeats expert id " << ids[j];
          return o.str();
        }
      }
    }
  }
  return "";
}

}  // namespace

Filler parse_filler(const std::string& name) {
  if (name == "minus_one") return Filler::MinusOne;
  if (name == "arange") return Filler::Arange;
  if (name == "spread") return Filler::Spread;
  throw Error("filler \"" + name + "\" is not one of minus_one, arange, spread");
}

StagedCall stage_call(const RouteArray& routes, int prev_len, int T, Filler filler,
                      StagePolicy policy, int num_experts, int call_index) {
  const int N = routes.start;
  const std::string where = call_prefix(call_index, T, prev_len, N);
  // Argument errors are caller bugs, not bad routes: they throw under either policy.
  if (T < 1) throw Error(where + "T must be >= 1");
  if (prev_len < 0 || prev_len > T) {
    std::ostringstream o;
    o << where << "prev_len outside [0, T]; expected " << std::max(0, T - prev_len)
      << " new rows, found prev_len " << prev_len;
    throw Error(o.str());
  }
  if (num_experts < 1) throw Error(where + "num_experts must be >= 1");

  const int new_rows = T - prev_len;
  StagedCall out;
  out.prev_len = prev_len;
  out.total_len = T;
  out.call_index = call_index;
  out.num_experts = num_experts;

  // ---- whole-call (shape) problems -------------------------------------------------------
  std::string problem;
  {
    std::ostringstream o;
    const long long expected = (N >= 0 && N <= T - 1) ? (T - 1 - N) : (T - 1);
    const size_t want_values = size_t(std::max(0, routes.rows)) *
                               size_t(std::max(0, routes.layers)) * size_t(std::max(0, routes.k));
    if (N < 0 || N > T - 1) {
      o << "delta start " << N << " outside [0, T-1=" << T - 1 << "]; expected " << expected
        << " rows, found " << routes.rows;
    } else if (routes.rows != expected) {
      o << "wrong number of route rows (T-1-start); expected " << expected << " rows, found "
        << routes.rows;
    } else if (N > prev_len) {
      o << "reply starts at position " << N << ", after prev_len, so positions [" << prev_len
        << ", " << N << ") have no route; expected " << (T - 1 - prev_len) << " rows from position "
        << prev_len << ", found " << routes.rows << " rows from " << N;
    } else if (routes.layers < 1 || routes.k < 1) {
      o << "bad shape [" << routes.rows << ", " << routes.layers << ", " << routes.k
        << "] (layers and k must be >= 1); expected " << expected << " rows, found " << routes.rows;
    } else if (routes.data.size() != want_values) {
      o << "data holds " << routes.data.size() << " ids but shape [" << routes.rows << ", "
        << routes.layers << ", " << routes.k << "] needs " << want_values << "; expected "
        << expected << " rows, found " << routes.rows;
    } else if (routes.k > num_experts) {
      o << "k=" << routes.k << " exceeds num_experts=" << num_experts << "; expected " << expected
        << " rows, found " << routes.rows;
    } else if (!routes.moe_layers.empty() && int(routes.moe_layers.size()) != routes.layers) {
      o << "moe_layers names " << routes.moe_layers.size() << " layers but shape has "
        << routes.layers << "; expected " << expected << " rows, found " << routes.rows;
    }
    problem = o.str();
  }

  const int L = std::max(0, routes.layers), K = std::max(0, routes.k);
  if (!problem.empty()) {
    if (policy == StagePolicy::Strict) throw Error(where + problem);
    // Lenient: keep the call, every row -1 (filler included: nothing of this call is trusted).
    out.rows = RouteArray(new_rows, L, K, int16_t(-1));
    out.rows.start = prev_len;
    if (int(routes.moe_layers.size()) == L) out.rows.moe_layers = routes.moe_layers;
    out.ok = false;
    out.reply_well_formed = false;
    out.bad_rows = new_rows;
    out.warning =
        where + problem + "; routes dropped, " + std::to_string(new_rows) + " rows set to -1";
    return out;
  }

  // ---- per-row problems (only rows this call keeps: positions [prev_len, T-1)) -------------
  out.rows = RouteArray(new_rows, L, K, int16_t(-1));
  out.rows.start = prev_len;
  out.rows.moe_layers = routes.moe_layers;
  const size_t row_size = size_t(L) * size_t(K);
  std::vector<std::string> row_problems;
  for (int p = prev_len; p < T - 1; ++p) {
    const int16_t* src = routes.row(p - N);
    bool all_minus_one = false;
    std::string why = check_row(src, L, K, num_experts, &all_minus_one);
    if (why.empty() && all_minus_one)
      why = "row is all -1 (the engine has no route for this token)";
    if (!why.empty()) {
      std::ostringstream o;
      o << "route row for position " << p << ": " << why << "; expected " << routes.rows
        << " rows, found " << routes.rows;
      if (policy == StagePolicy::Strict) throw Error(where + o.str());
      row_problems.push_back(o.str());
      continue;  // stays -1
    }
    std::memcpy(out.rows.row(p - prev_len), src, row_size * sizeof(int16_t));
  }
  // Filler row for the last token (position T-1), if this call keeps it.
  if (new_rows >= 1) {
    int16_t* f = out.rows.row(new_rows - 1);
    const int64_t pos = T - 1;
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < K; ++j) {
        int16_t id = -1;
        if (filler == Filler::Arange)
          id = int16_t(j);
        else if (filler == Filler::Spread)
          id = int16_t(((pos * L + l) * K + j) % num_experts);
        f[size_t(l) * K + j] = id;
      }
    out.filler_rows = 1;
  }
  if (!row_problems.empty()) {
    // Lenient drops the whole call: a reply with a bad row is not trusted anywhere.
    std::fill(out.rows.data.begin(), out.rows.data.end(), int16_t(-1));
    out.filler_rows = 0;
    out.ok = false;
    out.bad_rows = int(row_problems.size());
    std::ostringstream o;
    o << where << row_problems.size() << " bad or missing route row(s), routes dropped, "
      << new_rows << " rows set to -1: " << row_problems[0];
    for (size_t i = 1; i < row_problems.size() && i < 3; ++i) o << " | " << row_problems[i];
    if (row_problems.size() > 3) o << " | ...";
    out.warning = o.str();
  }
  return out;
}

std::vector<uint64_t> row_versions(const std::vector<uint64_t>& weight_versions, int prev_len,
                                   int T) {
  const int generated = int(weight_versions.size());
  if (generated == 0) return {};
  if (prev_len < 0 || prev_len > T || generated > T) {
    std::ostringstream o;
    o << "row_versions: " << generated << " generated tokens do not fit a call of positions ["
      << prev_len << ", " << T << ")";
    throw Error(o.str());
  }
  const int P = T - generated;
  std::vector<uint64_t> v;
  v.reserve(size_t(T - prev_len));
  for (int p = prev_len; p < T; ++p)
    v.push_back(weight_versions[size_t(std::clamp(p - P + 1, 0, generated - 1))]);
  return v;
}

VersionPolicy parse_version_policy(const std::string& name) {
  if (name == "keep") return VersionPolicy::Keep;
  if (name == "drop_call") return VersionPolicy::DropCall;
  if (name == "fail") return VersionPolicy::Fail;
  throw Error("version policy must be keep, drop_call or fail, got \"" + name + "\"");
}

namespace {

// The rollout's per-row versions (when every call has them), the mixed flag, and the policy.
void apply_version_policy(const std::vector<StagedCall>& calls, VersionPolicy policy,
                          RouteArray& out, AssembleReport& rep) {
  const bool known = std::all_of(calls.begin(), calls.end(), [](const StagedCall& c) {
    return int(c.versions.size()) == c.total_len - c.prev_len;
  });
  if (!known) {
    rep.versions.clear();
    if (policy == VersionPolicy::Keep) return;
    throw Error(
        "assemble_rollout: the drop_call and fail version policies need every call's weight "
        "versions "
        "(stage_call with weight_versions)");
  }
  if (rep.versions.empty()) return;
  const auto [lo, hi] = std::minmax_element(rep.versions.begin(), rep.versions.end());
  rep.mixed_versions = *lo != *hi;
  if (!rep.mixed_versions || policy == VersionPolicy::Keep) return;
  std::ostringstream stale;
  for (size_t i = 0; i < calls.size(); ++i) {
    const StagedCall& c = calls[i];
    const int from = c.prev_len - calls.front().prev_len, rows = c.total_len - c.prev_len;
    const auto oldest =
        std::min_element(rep.versions.begin() + from, rep.versions.begin() + from + rows);
    if (rows == 0 || *oldest == *hi) continue;
    stale << (stale.tellp() ? ", " : "") << "call " << c.call_index << " (#" << i
          << ") has rows of version " << *oldest;
    if (policy == VersionPolicy::DropCall) {
      std::fill(out.row(from), out.row(from) + size_t(rows) * size_t(out.layers) * size_t(out.k),
                int16_t(-1));
      ++rep.version_dropped_calls;
    }
  }
  if (policy == VersionPolicy::Fail)
    throw Error("assemble_rollout: the rollout's rows span weight versions " + std::to_string(*lo) +
                " to " + std::to_string(*hi) + ": " + stale.str() + " (version policy fail)");
}

}  // namespace

RouteArray assemble_rollout(const std::vector<StagedCall>& calls,
                            const std::vector<RouteArray>& engine_routes, bool repair_boundaries,
                            AssembleReport* report, VersionPolicy versions) {
  AssembleReport rep;
  if (calls.empty()) {
    if (report) *report = rep;
    return RouteArray();
  }
  // The rollout's [L, K]: the first call whose rows have a real shape.
  int L = 0, K = 0;
  const std::vector<int>* moe_layers = nullptr;
  for (const auto& c : calls) {
    if (c.rows.layers > 0 && c.rows.k > 0) {
      L = c.rows.layers;
      K = c.rows.k;
      break;
    }
  }
  for (const auto& c : calls)
    if (c.rows.layers == L && c.rows.k == K && int(c.rows.moe_layers.size()) == L && L > 0) {
      moe_layers = &c.rows.moe_layers;
      break;
    }

  const int first = calls.front().prev_len;
  int covered = first;  // positions covered so far
  for (size_t i = 0; i < calls.size(); ++i) {
    const StagedCall& c = calls[i];
    const int want = c.total_len - c.prev_len;
    if (c.prev_len != covered) {
      std::ostringstream o;
      o << "assemble_rollout: call " << c.call_index << " (#" << i << "): prev_len " << c.prev_len
        << " but the earlier calls cover positions [" << first << ", " << covered
        << "); expected rows from position " << covered << ", found rows from " << c.prev_len;
      throw Error(o.str());
    }
    if (c.rows.rows != want ||
        c.rows.data.size() != size_t(c.rows.rows) * c.rows.layers * c.rows.k) {
      std::ostringstream o;
      o << "assemble_rollout: call " << c.call_index << " (#" << i << "): expected " << want
        << " rows (total_len - prev_len), found " << c.rows.rows;
      throw Error(o.str());
    }
    if (want > 0 && (c.rows.layers != L || c.rows.k != K)) {
      bool all_minus =
          std::all_of(c.rows.data.begin(), c.rows.data.end(), [](int16_t v) { return v == -1; });
      if (c.ok || !all_minus) {
        std::ostringstream o;
        o << "assemble_rollout: call " << c.call_index << " (#" << i << "): shape [" << c.rows.rows
          << ", " << c.rows.layers << ", " << c.rows.k << "] does not match the rollout's [*, " << L
          << ", " << K << "]; expected " << want << " rows, found " << c.rows.rows;
        throw Error(o.str());
      }
    }
    covered = c.total_len;
  }

  RouteArray out(covered - first, L, K, int16_t(-1));
  out.start = first;
  if (moe_layers) out.moe_layers = *moe_layers;
  const size_t row_size = size_t(L) * size_t(K);
  for (const auto& c : calls) {
    if (c.rows.layers == L && c.rows.k == K && c.rows.rows > 0)
      std::memcpy(out.row(c.prev_len - first), c.rows.data.data(),
                  c.rows.data.size() * sizeof(int16_t));
    // else: a failed lenient call without a usable shape stays -1
    rep.filler_rows += c.filler_rows;
    rep.versions.insert(rep.versions.end(), c.versions.begin(), c.versions.end());
  }

  if (repair_boundaries && !engine_routes.empty()) {
    if (engine_routes.size() != calls.size()) {
      std::ostringstream o;
      o << "assemble_rollout: boundary repair needs one engine reply per call; expected "
        << calls.size() << ", found " << engine_routes.size();
      throw Error(o.str());
    }
    for (size_t i = 1; i < calls.size(); ++i) {
      const StagedCall& prev = calls[i - 1];
      const StagedCall& next = calls[i];
      const RouteArray& eng = engine_routes[i];
      const int p = next.prev_len - 1;                   // the previous call's last token
      if (prev.total_len - prev.prev_len < 1) continue;  // previous call holds no row for p
      if (!next.reply_well_formed) continue;             // its rows cannot be located by position
      if (eng.layers != L || eng.k != K) continue;
      if (eng.data.size() != size_t(eng.rows) * row_size) continue;
      if (p < eng.start || p >= eng.start + eng.rows) continue;  // reply does not cover p
      const int16_t* src = eng.row(p - eng.start);
      bool all_minus = false;
      const int E = next.num_experts > 0 ? next.num_experts : std::numeric_limits<int16_t>::max();
      if (!check_row(src, L, K, E, &all_minus).empty() || all_minus) continue;
      std::memcpy(out.row(p - first), src, row_size * sizeof(int16_t));
      ++rep.repaired_boundary_rows;
      if (prev.filler_rows > 0) --rep.filler_rows;
      // The repaired row was computed in the next call's prefill.
      if (!next.versions.empty() && size_t(p - first) < rep.versions.size())
        rep.versions[size_t(p - first)] = next.versions.front();
    }
  }
  apply_version_policy(calls, versions, out, rep);
  if (report) *report = rep;
  return out;
}

}  // namespace r3
