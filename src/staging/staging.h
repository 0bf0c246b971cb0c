// Trainer-side staging (DESIGN.md "Trainer side"): turns each engine call's routes
// [T-1, L, K] into the rows of its new tokens, and joins a multi-turn rollout's calls into one
// [T_total, L, K].
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "routes/route_array.h"

namespace r3 {

// The row of a call's last token (the engine routed no token after it): -1 (the trainer's router
// decides), experts 0..K-1 forced, or `Spread`: forced ids that vary with the position and the
// layer, experts (base + j) mod E with base = (position * L + layer) * K, so padding does not pile
// onto one expert or rank (the fill slime, SkyRL and miles moved to).
enum class Filler { MinusOne, Arange, Spread };
// "minus_one" | "arange" | "spread"; anything else throws r3::Error naming the choices.
Filler parse_filler(const std::string& name);
enum class StagePolicy { Strict, Lenient };

struct StagedCall {
  RouteArray rows;  // [T - prev_len, L, K]
  int prev_len = 0, total_len = 0;
  int filler_rows = 0;            // rows holding filler
  bool ok = true;                 // false under lenient policy when routes were bad (rows are -1)
  bool reply_well_formed = true;  // false when the reply's shape, row count or start was wrong
  std::string warning;            // why, under lenient
  int call_index = 0;             // as passed to stage_call (names the call in later errors)
  int bad_rows = 0;               // lenient: kept rows that were bad or missing and became -1
  int num_experts = 0;            // as passed to stage_call (validates boundary-repair rows)
  // The weight version each kept row was computed under (row_versions), when the caller knows
  // the call's per-token versions; empty: unknown.
  std::vector<uint64_t> versions;
};

// The weight version of each kept row [prev_len, T) of a call, from the engine's per-token
// versions (weight_versions: one per generated token, the version of the step that sampled it;
// /generate's meta_info.weight_versions, RequestOutput.weight_versions). With P = T - generated,
// the row of position p >= P-1 was computed in the step that sampled token p+1; an earlier prompt
// row in the call's prefill, which ended in the first token's step; the last token's row (the
// filler) takes the last token's version. Empty when nothing was generated (the versions are
// unknown). Throws r3::Error when more tokens are given than the call holds.
std::vector<uint64_t> row_versions(const std::vector<uint64_t>& weight_versions, int prev_len,
                                   int T);

// routes: the engine's rows for this call. If routes.start == 0 it must hold T-1 rows; a delta
// reply (routes.start == N) holds rows [N, T-1). One filler row is appended for the last token,
// then rows [prev_len, T) are kept. Strict: any problem (wrong row count or shape, ids out of
// [0, num_experts), partly -1 rows, duplicates, an engine row that is all -1) throws r3::Error
// naming `call_index` and the expected and found row counts. Lenient: the whole call's routes
// are dropped (every row of the call -1, filler row included, `ok` false, `warning` says why)
// and the rollout is kept.
//
// Details: only the rows this call keeps (positions [prev_len, T-1)) are checked row by row. A
// delta start after prev_len leaves kept positions without a route and counts as a row-count
// problem. A dropped call has the shape [T - prev_len, L, K] taken from `routes` (0 x 0 when
// routes has none).
// Bad arguments (T < 1, prev_len outside [0, T], num_experts < 1) throw under either policy.
StagedCall stage_call(const RouteArray& routes, int prev_len, int T, Filler filler,
                      StagePolicy policy, int num_experts, int call_index = 0);

// What a rollout whose rows span weight versions (a refit landed while it ran) gives the trainer:
// Keep: every row as computed (the report says the versions are mixed); DropCall: the routes of
// each call holding a row of an older version than the rollout's newest become -1 (the trainer's
// router decides them, as for a dropped lenient call); Fail: r3::Error naming the calls and
// versions. DropCall and Fail need every call's versions.
enum class VersionPolicy { Keep, DropCall, Fail };
// "keep" | "drop_call" | "fail"; anything else throws r3::Error naming the choices.
VersionPolicy parse_version_policy(const std::string& name);

struct AssembleReport {
  int repaired_boundary_rows =
      0;                // previous call's last row overwritten with the next call's real route
  int filler_rows = 0;  // filler rows left in the assembled rollout
  std::vector<uint64_t> versions;  // per assembled row (empty unless every call had versions)
  bool mixed_versions = false;     // the rows span more than one weight version
  int version_dropped_calls = 0;   // DropCall: calls whose routes became -1
};

// Joins staged calls in order into [sum of rows, L, K]. Turn-boundary repair (on by default):
// when call i+1's engine reply covers position prev_len-1 (its delta start <= prev_len-1), the
// real route it computed for that token replaces call i's filler row. `engine_routes[i]` is the
// raw engine reply of call i (needed for repair); pass an empty vector to disable repair.
//
// Details: calls must be contiguous (call i+1's prev_len == call i's total_len) or r3::Error is
// thrown naming the call. A row is repaired from a well-formed engine reply of the rollout's
// [L, K] whose row for that position is fully valid (not -1), even when other rows of that call
// were bad (the call itself then stays dropped); engine_routes[0] is never read. A failed lenient
// call whose rows have no shape is laid out as -1 rows.
RouteArray assemble_rollout(const std::vector<StagedCall>& calls,
                            const std::vector<RouteArray>& engine_routes, bool repair_boundaries,
                            AssembleReport* report = nullptr,
                            VersionPolicy versions = VersionPolicy::Keep);

}  // namespace r3
