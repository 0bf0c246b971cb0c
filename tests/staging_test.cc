// Trainer-side staging (src/staging): per-call staging, rollout assembly with turn-boundary
// repair, the NeMo-RL route envelope, and the alignment metrics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "routes/route_envelope.h"
#include "staging/alignment.h"
#include "staging/staging.h"

namespace r3 {
namespace {

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

// Ground truth for the two-call example: the route of absolute position p at MoE layer l is
// K distinct ids (base + j) % E.
constexpr int kE = 64, kL = 2, kK = 6;
int16_t gt_id(int p, int l, int j) { return int16_t((p * 7 + l * 13 + j) % kE); }

// What the engine returns for a call of T tokens with delta start N: rows [N, T-1).
RouteArray engine_reply(int T, int N) {
  RouteArray r(T - 1 - N, kL, kK);
  r.start = N;
  r.moe_layers = {1, 3};
  for (int p = N; p < T - 1; ++p)
    for (int l = 0; l < kL; ++l)
      for (int j = 0; j < kK; ++j) r.at(p - N, l, j) = gt_id(p, l, j);
  return r;
}

bool row_is_gt(const RouteArray& a, int row, int pos) {
  for (int l = 0; l < a.layers; ++l)
    for (int j = 0; j < a.k; ++j)
      if (a.at(row, l, j) != gt_id(pos, l, j)) return false;
  return true;
}

bool row_is_filler(const RouteArray& a, int row, Filler f) {
  for (int l = 0; l < a.layers; ++l)
    for (int j = 0; j < a.k; ++j)
      if (a.at(row, l, j) != (f == Filler::Arange ? j : -1)) return false;
  return true;
}

bool row_is_minus_one(const RouteArray& a, int row) {
  for (int l = 0; l < a.layers; ++l)
    for (int j = 0; j < a.k; ++j)
      if (a.at(row, l, j) != -1) return false;
  return true;
}

bool contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// Runs `f`, expects an r3::Error, returns its message.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected r3::Error";
  return "";
}

const char* filler_name(Filler f) { return f == Filler::Arange ? "arange" : "minus_one"; }

// ---------------------------------------------------------------------------------------------
// The two-call example of the staging document.
// Call 1: 3-token prompt + 4 generated = 7 tokens, prev_len 0 -> 7 rows (row 6 = filler).
// Call 2: the 7, then 8 user tokens, then 9 generated = 24 tokens, prev_len 7 -> 17 rows.
// 2 MoE layers, top-6.
// ---------------------------------------------------------------------------------------------

TEST(StagingTwoCall, ShapesAndRowsBothFillersNoRepair) {
  for (Filler f : {Filler::MinusOne, Filler::Arange}) {
    SCOPED_TRACE(filler_name(f));
    RouteArray r1 = engine_reply(7, 0);   // [6, 2, 6]
    RouteArray r2 = engine_reply(24, 0);  // [23, 2, 6]
    ASSERT_EQ(r1.rows, 6);
    ASSERT_EQ(r2.rows, 23);
    StagedCall c1 = stage_call(r1, 0, 7, f, StagePolicy::Strict, kE, 1);
    StagedCall c2 = stage_call(r2, 7, 24, f, StagePolicy::Strict, kE, 2);
    EXPECT_EQ(c1.rows.rows, 7);
    EXPECT_EQ(c2.rows.rows, 17);
    EXPECT_EQ(c1.rows.layers, 2);
    EXPECT_EQ(c1.rows.k, 6);
    EXPECT_EQ(c1.rows.start, 0);
    EXPECT_EQ(c2.rows.start, 7);
    EXPECT_EQ(c2.rows.moe_layers, (std::vector<int>{1, 3}));
    EXPECT_TRUE(c1.ok && c2.ok);
    EXPECT_EQ(c1.filler_rows, 1);
    EXPECT_EQ(c2.filler_rows, 1);
    for (int p = 0; p < 6; ++p) EXPECT_TRUE(row_is_gt(c1.rows, p, p)) << p;
    EXPECT_TRUE(row_is_filler(c1.rows, 6, f));
    for (int p = 7; p < 23; ++p) EXPECT_TRUE(row_is_gt(c2.rows, p - 7, p)) << p;
    EXPECT_TRUE(row_is_filler(c2.rows, 16, f));

    AssembleReport rep;
    RouteArray all =
        assemble_rollout({c1, c2}, {}, /*repair_boundaries=*/true, &rep);  // no replies: no repair
    ASSERT_EQ(all.rows, 24);
    EXPECT_EQ(all.layers, 2);
    EXPECT_EQ(all.k, 6);
    EXPECT_EQ(rep.repaired_boundary_rows, 0);
    EXPECT_EQ(rep.filler_rows, 2);
    for (int p = 0; p < 24; ++p) {
      if (p == 6 || p == 23)
        EXPECT_TRUE(row_is_filler(all, p, f)) << p;  // column 6 keeps its filler, column 23 too
      else
        EXPECT_TRUE(row_is_gt(all, p, p)) << p;
    }
    // repair_boundaries=false with the replies given: same result.
    RouteArray all2 = assemble_rollout({c1, c2}, {r1, r2}, false, &rep);
    EXPECT_EQ(all2.data, all.data);
    EXPECT_EQ(rep.repaired_boundary_rows, 0);
    EXPECT_EQ(rep.filler_rows, 2);
  }
}

TEST(StagingTwoCall, BoundaryRepairFromFullOrDeltaReply) {
  for (Filler f : {Filler::MinusOne, Filler::Arange}) {
    for (int start2 : {0, 6}) {  // call 2 replies from 0, or from prev_len - 1 = 6
      SCOPED_TRACE(std::string(filler_name(f)) + " start2=" + std::to_string(start2));
      RouteArray r1 = engine_reply(7, 0);
      RouteArray r2 = engine_reply(24, start2);
      EXPECT_EQ(r2.rows, 23 - start2);
      StagedCall c1 = stage_call(r1, 0, 7, f, StagePolicy::Strict, kE, 1);
      StagedCall c2 = stage_call(r2, 7, 24, f, StagePolicy::Strict, kE, 2);
      ASSERT_EQ(c2.rows.rows, 17);
      AssembleReport rep;
      RouteArray all = assemble_rollout({c1, c2}, {r1, r2}, true, &rep);
      ASSERT_EQ(all.rows, 24);
      EXPECT_EQ(rep.repaired_boundary_rows, 1);
      EXPECT_EQ(rep.filler_rows, 1);  // only the rollout's last token keeps its filler
      // Token 6 now holds call 2's engine row for position 6.
      for (int l = 0; l < kL; ++l)
        for (int j = 0; j < kK; ++j) EXPECT_EQ(all.at(6, l, j), r2.at(6 - start2, l, j));
      for (int p = 0; p < 23; ++p) EXPECT_TRUE(row_is_gt(all, p, p)) << p;
      EXPECT_TRUE(row_is_filler(all, 23, f));
      // Without repair the filler stays.
      RouteArray plain = assemble_rollout({c1, c2}, {r1, r2}, false, &rep);
      EXPECT_TRUE(row_is_filler(plain, 6, f));
      EXPECT_EQ(rep.repaired_boundary_rows, 0);
      EXPECT_EQ(rep.filler_rows, 2);
    }
  }
}

TEST(StagingTwoCall, NoRepairWhenReplyStartsAtPrevLen) {
  RouteArray r1 = engine_reply(7, 0);
  RouteArray r2 = engine_reply(24, 7);  // delta from prev_len: position 6 not covered
  StagedCall c1 = stage_call(r1, 0, 7, Filler::MinusOne, StagePolicy::Strict, kE, 1);
  StagedCall c2 = stage_call(r2, 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2);
  AssembleReport rep;
  RouteArray all = assemble_rollout({c1, c2}, {r1, r2}, true, &rep);
  EXPECT_EQ(rep.repaired_boundary_rows, 0);
  EXPECT_EQ(rep.filler_rows, 2);
  EXPECT_TRUE(row_is_minus_one(all, 6));
  for (int p = 7; p < 23; ++p) EXPECT_TRUE(row_is_gt(all, p, p)) << p;
}

TEST(StagingTwoCall, StrictWrongRowCountThrowsNamingCallAndRows) {
  for (Filler f : {Filler::MinusOne, Filler::Arange}) {
    SCOPED_TRACE(filler_name(f));
    RouteArray r2 = engine_reply(24, 0);
    r2.rows = 22;  // one row short
    r2.data.resize(size_t(22) * kL * kK);
    std::string msg = error_of([&] { stage_call(r2, 7, 24, f, StagePolicy::Strict, kE, 2); });
    EXPECT_TRUE(contains(msg, "call 2")) << msg;
    EXPECT_TRUE(contains(msg, "expected 23 rows")) << msg;
    EXPECT_TRUE(contains(msg, "found 22")) << msg;
    // Routes missing altogether (an empty reply).
    msg = error_of([&] { stage_call(RouteArray(), 7, 24, f, StagePolicy::Strict, kE, 2); });
    EXPECT_TRUE(contains(msg, "call 2") && contains(msg, "expected 23 rows") &&
                contains(msg, "found 0"))
        << msg;
  }
}

TEST(StagingTwoCall, LenientWrongRowCountKeepsCallWithMinusOneRows) {
  for (Filler f : {Filler::MinusOne, Filler::Arange}) {
    SCOPED_TRACE(filler_name(f));
    RouteArray r1 = engine_reply(7, 0);
    RouteArray r2 = engine_reply(24, 0);
    r2.rows = 22;
    r2.data.resize(size_t(22) * kL * kK);
    StagedCall c1 = stage_call(r1, 0, 7, f, StagePolicy::Lenient, kE, 1);
    StagedCall c2 = stage_call(r2, 7, 24, f, StagePolicy::Lenient, kE, 2);
    EXPECT_TRUE(c1.ok);
    EXPECT_TRUE(c1.warning.empty());
    EXPECT_FALSE(c2.ok);
    EXPECT_TRUE(contains(c2.warning, "call 2")) << c2.warning;
    EXPECT_TRUE(contains(c2.warning, "expected 23 rows")) << c2.warning;
    EXPECT_TRUE(contains(c2.warning, "found 22")) << c2.warning;
    ASSERT_EQ(c2.rows.rows, 17);
    EXPECT_EQ(c2.bad_rows, 17);
    for (int r = 0; r < 17; ++r) EXPECT_TRUE(row_is_minus_one(c2.rows, r)) << r;
    AssembleReport rep;
    RouteArray all = assemble_rollout({c1, c2}, {r1, r2}, true, &rep);
    ASSERT_EQ(all.rows, 24);
    EXPECT_EQ(rep.repaired_boundary_rows, 0);  // a failed call's reply is not trusted for repair
    for (int p = 0; p < 6; ++p) EXPECT_TRUE(row_is_gt(all, p, p));
    EXPECT_TRUE(row_is_filler(all, 6, f));
    for (int p = 7; p < 24; ++p) EXPECT_TRUE(row_is_minus_one(all, p)) << p;
  }
}

TEST(StagingTwoCall, LenientEmptyReplyAssemblesWithRolloutShape) {
  RouteArray r1 = engine_reply(7, 0);
  StagedCall c1 = stage_call(r1, 0, 7, Filler::Arange, StagePolicy::Lenient, kE, 1);
  StagedCall c2 = stage_call(RouteArray(), 7, 24, Filler::Arange, StagePolicy::Lenient, kE, 2);
  EXPECT_FALSE(c2.ok);
  EXPECT_EQ(c2.rows.rows, 17);
  RouteArray all = assemble_rollout({c1, c2}, {}, true);
  ASSERT_EQ(all.rows, 24);
  ASSERT_EQ(all.layers, kL);
  ASSERT_EQ(all.k, kK);
  for (int p = 7; p < 24; ++p) EXPECT_TRUE(row_is_minus_one(all, p)) << p;
}

// ---------------------------------------------------------------------------------------------
// Single-call validation.
// ---------------------------------------------------------------------------------------------

TEST(StagingCall, BadRowsStrictThrowLenientMinusOne) {
  struct Case {
    const char* name;
    void (*spoil)(RouteArray&);  // spoils the row of position 10 (reply starts at 0)
    const char* what;
  };
  const Case cases[] = {
      {"out of range", [](RouteArray& r) { r.at(10, 1, 2) = kE; }, "outside [0, 64)"},
      {"negative", [](RouteArray& r) { r.at(10, 0, 0) = -7; }, "outside [0, 64)"},
      {"partly -1", [](RouteArray& r) { r.at(10, 0, 3) = -1; }, "partly -1"},
      {"duplicate", [](RouteArray& r) { r.at(10, 1, 4) = r.at(10, 1, 0); }, "repeats expert id"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RouteArray r = engine_reply(24, 0);
    c.spoil(r);
    std::string msg =
        error_of([&] { stage_call(r, 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 5); });
    EXPECT_TRUE(contains(msg, "call 5")) << msg;
    EXPECT_TRUE(contains(msg, "position 10")) << msg;
    EXPECT_TRUE(contains(msg, c.what)) << msg;
    EXPECT_TRUE(contains(msg, "expected 23 rows, found 23")) << msg;

    // Lenient drops the whole call's routes (filler row included), not only the bad row.
    StagedCall s = stage_call(r, 7, 24, Filler::Arange, StagePolicy::Lenient, kE, 5);
    EXPECT_FALSE(s.ok);
    EXPECT_EQ(s.bad_rows, 1);
    EXPECT_EQ(s.filler_rows, 0);
    EXPECT_TRUE(contains(s.warning, "call 5") && contains(s.warning, c.what)) << s.warning;
    EXPECT_TRUE(contains(s.warning, "routes dropped")) << s.warning;
    ASSERT_EQ(s.rows.rows, 17);
    for (int p = 7; p < 24; ++p) EXPECT_TRUE(row_is_minus_one(s.rows, p - 7)) << p;
  }
}

TEST(StagingCall, BadRowBeforePrevLenIsNotThisCallsConcern) {
  RouteArray r = engine_reply(24, 0);
  r.at(3, 0, 0) = -1;  // partly -1, but position 3 belongs to an earlier call
  StagedCall s = stage_call(r, 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2);
  EXPECT_TRUE(s.ok);
}

// An engine row that is all -1 is a missing route: strict fails the call, lenient drops it.
TEST(StagingCall, AllMinusOneEngineRowFailsStrictDropsLenient) {
  RouteArray r = engine_reply(24, 0);
  for (int l = 0; l < kL; ++l)
    for (int j = 0; j < kK; ++j) r.at(12, l, j) = -1;
  std::string msg =
      error_of([&] { stage_call(r, 7, 24, Filler::Arange, StagePolicy::Strict, kE, 2); });
  EXPECT_TRUE(contains(msg, "call 2") && contains(msg, "position 12") && contains(msg, "all -1"))
      << msg;
  StagedCall s = stage_call(r, 7, 24, Filler::Arange, StagePolicy::Lenient, kE, 2);
  EXPECT_FALSE(s.ok);
  for (int p = 7; p < 24; ++p) EXPECT_TRUE(row_is_minus_one(s.rows, p - 7)) << p;
}

// The boundary row is repaired from the next call's reply when that row is valid, even when
// another row of the next call is bad (that call stays dropped under lenient).
TEST(StagingTwoCall, BoundaryRepairedDespiteABadRowElsewhereInTheNextCall) {
  RouteArray r1 = engine_reply(7, 0);
  RouteArray r2 = engine_reply(24, 0);
  r2.at(15, 0, 0) = -1;  // partly -1 at position 15, far from the boundary (position 6)
  StagedCall c1 = stage_call(r1, 0, 7, Filler::MinusOne, StagePolicy::Lenient, kE, 1);
  StagedCall c2 = stage_call(r2, 7, 24, Filler::MinusOne, StagePolicy::Lenient, kE, 2);
  EXPECT_TRUE(c1.ok);
  EXPECT_FALSE(c2.ok);
  AssembleReport rep;
  RouteArray all = assemble_rollout({c1, c2}, {r1, r2}, true, &rep);
  EXPECT_EQ(rep.repaired_boundary_rows, 1);
  for (int p = 0; p < 7; ++p) EXPECT_TRUE(row_is_gt(all, p, p)) << p;
  for (int p = 7; p < 24; ++p) EXPECT_TRUE(row_is_minus_one(all, p)) << p;
  // A bad boundary row itself is never used.
  r2.at(6, 1, 1) = -1;
  RouteArray none = assemble_rollout({c1, c2}, {r1, r2}, true, &rep);
  EXPECT_EQ(rep.repaired_boundary_rows, 0);
  EXPECT_TRUE(row_is_minus_one(none, 6));
}

TEST(StagingCall, DeltaStartAfterPrevLenIsMissingRows) {
  RouteArray r = engine_reply(24, 9);  // positions 7, 8 have no route
  std::string msg =
      error_of([&] { stage_call(r, 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2); });
  EXPECT_TRUE(contains(msg, "call 2") && contains(msg, "expected 16 rows") &&
              contains(msg, "found 14"))
      << msg;
  StagedCall s = stage_call(r, 7, 24, Filler::MinusOne, StagePolicy::Lenient, kE, 2);
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.rows.rows, 17);
}

TEST(StagingCall, ShapeAndArgumentErrors) {
  RouteArray r = engine_reply(24, 0);
  RouteArray bad = r;
  bad.data.pop_back();  // data does not match the shape
  EXPECT_THROW(stage_call(bad, 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2), Error);
  EXPECT_THROW(stage_call(r, 7, 24, Filler::Arange, StagePolicy::Strict, /*num_experts=*/4, 2),
               Error);  // K > E
  bad = r;
  bad.start = 30;
  EXPECT_THROW(stage_call(bad, 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2), Error);
  bad = r;
  bad.moe_layers = {1, 3, 5};
  EXPECT_THROW(stage_call(bad, 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2), Error);
  // Argument errors throw even under lenient.
  EXPECT_THROW(stage_call(r, 25, 24, Filler::MinusOne, StagePolicy::Lenient, kE, 2), Error);
  EXPECT_THROW(stage_call(r, -1, 24, Filler::MinusOne, StagePolicy::Lenient, kE, 2), Error);
  EXPECT_THROW(stage_call(r, 7, 0, Filler::MinusOne, StagePolicy::Lenient, kE, 2), Error);
}

TEST(StagingCall, PrevLenEqualToTKeepsNothing) {
  RouteArray r = engine_reply(7, 0);
  StagedCall s = stage_call(r, 7, 7, Filler::Arange, StagePolicy::Strict, kE, 3);
  EXPECT_EQ(s.rows.rows, 0);
  EXPECT_EQ(s.filler_rows, 0);
}

TEST(StagingAssemble, NonContiguousCallsThrowNamingTheCall) {
  StagedCall c1 =
      stage_call(engine_reply(7, 0), 0, 7, Filler::MinusOne, StagePolicy::Strict, kE, 1);
  StagedCall c2 =
      stage_call(engine_reply(24, 0), 8, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2);
  std::string msg = error_of([&] { assemble_rollout({c1, c2}, {}, false); });
  EXPECT_TRUE(contains(msg, "call 2") && contains(msg, "expected rows from position 7") &&
              contains(msg, "found rows from 8"))
      << msg;
  // Replies for repair must be one per call.
  StagedCall c2ok =
      stage_call(engine_reply(24, 0), 7, 24, Filler::MinusOne, StagePolicy::Strict, kE, 2);
  EXPECT_THROW(assemble_rollout({c1, c2ok}, {engine_reply(7, 0)}, true), Error);
  EXPECT_EQ(assemble_rollout({}, {}, true).rows, 0);
}

// ---------------------------------------------------------------------------------------------
// Seeded random multi-turn rollouts: assembled rows equal the ground-truth per-position routes,
// except filler rows (each call's last token, unless repaired from the next call).
// ---------------------------------------------------------------------------------------------

TEST(StagingRandom, MultiTurnRolloutsMatchGroundTruth) {
  std::mt19937 rng(20240611);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int total_repaired = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const int E = std::vector<int>{8, 64, 128, 300}[uni(0, 3)];
    const int L = uni(1, 4), K = uni(1, std::min(8, E));
    const Filler f = uni(0, 1) ? Filler::Arange : Filler::MinusOne;
    const int turns = uni(1, 5);
    // Call lengths: prompt (first turn) or user tokens (>= 1) plus generated tokens (>= 1).
    std::vector<int> lens;
    int T = 0;
    for (int t = 0; t < turns; ++t) {
      T += uni(1, 20) + uni(1, 20);
      lens.push_back(T);
    }
    // Ground truth: K distinct random ids per (position, layer).
    std::vector<int16_t> gt(size_t(T) * L * K);
    std::vector<int> perm(E);
    for (int p = 0; p < T; ++p)
      for (int l = 0; l < L; ++l) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int j = 0; j < K; ++j) gt[(size_t(p) * L + l) * K + j] = int16_t(perm[j]);
      }
    std::vector<StagedCall> calls;
    std::vector<RouteArray> replies;
    std::vector<int> starts;
    int prev = 0;
    for (int t = 0; t < turns; ++t) {
      const int Tt = lens[t];
      // Reply: full, from prev_len - 1, or from prev_len.
      int N = std::vector<int>{0, std::max(0, prev - 1), prev}[uni(0, 2)];
      RouteArray r(Tt - 1 - N, L, K);
      r.start = N;
      std::copy(gt.begin() + size_t(N) * L * K, gt.begin() + size_t(Tt - 1) * L * K,
                r.data.begin());
      calls.push_back(stage_call(r, prev, Tt, f, StagePolicy::Strict, E, t));
      ASSERT_EQ(calls.back().rows.rows, Tt - prev);
      replies.push_back(r);
      starts.push_back(N);
      prev = Tt;
    }
    for (bool repair : {false, true}) {
      AssembleReport rep;
      RouteArray all = assemble_rollout(calls, replies, repair, &rep);
      ASSERT_EQ(all.rows, T);
      ASSERT_EQ(all.layers, L);
      ASSERT_EQ(all.k, K);
      int expect_repaired = 0;
      for (int p = 0; p < T; ++p) {
        // Is p the last token of some call t? Then it is filler unless repaired by call t+1.
        int t = int(std::find(lens.begin(), lens.end(), p + 1) - lens.begin());
        bool filler = t < turns;
        if (filler && repair && t + 1 < turns && starts[t + 1] <= p) {
          filler = false;
          ++expect_repaired;
        }
        const int16_t* row = all.row(p);
        for (int l = 0; l < L; ++l)
          for (int j = 0; j < K; ++j) {
            const int16_t want = filler ? (f == Filler::Arange ? int16_t(j) : int16_t(-1))
                                        : gt[(size_t(p) * L + l) * K + j];
            ASSERT_EQ(row[size_t(l) * K + j], want)
                << "iter " << iter << " pos " << p << " layer " << l << " repair " << repair;
          }
      }
      EXPECT_EQ(rep.repaired_boundary_rows, expect_repaired);
      EXPECT_EQ(rep.filler_rows, turns - expect_repaired);
      total_repaired += expect_repaired;
    }
  }
  EXPECT_GT(total_repaired, 50);  // the sampling exercised repair
}

// A call of positions [prev_len, T) whose last 3 tokens were generated (P = 5) under versions
// 1, 1, 2: a prompt row takes the first token's version (its prefill ended in that step), the row
// of position p >= P-1 the version of token p+1, the filler row the last token's.
TEST(StagingVersions, EachRowTakesTheVersionOfTheStepThatComputedIt) {
  EXPECT_EQ(row_versions({1, 1, 2}, 3, 8), (std::vector<uint64_t>{1, 1, 1, 2, 2}));
  EXPECT_EQ(row_versions({4, 5, 6}, 0, 4),
            (std::vector<uint64_t>{4, 5, 6, 6}));  // a one-token prompt
  EXPECT_TRUE(row_versions({}, 0, 5).empty());     // nothing generated: unknown
  EXPECT_THROW(row_versions({1, 1}, 0, 1), Error);
  EXPECT_EQ(parse_version_policy("drop_call"), VersionPolicy::DropCall);
  EXPECT_THROW(parse_version_policy("newest"), Error);
}

// Seeded multi-turn rollouts whose calls were generated across refits (each call's tokens get
// non-decreasing versions that may step inside the call): the report's per-row versions are
// row_versions' (the repaired boundary row its next call's prefill version), mixed_versions says
// whether they differ, keep changes no row, drop_call makes exactly the calls holding an older
// row -1, and fail throws exactly when they differ, naming the version span.
TEST(StagingVersions, RolloutsAcrossRefitsFollowTheVersionPolicy) {
  std::mt19937 rng(45);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int mixed = 0, dropped = 0;
  for (int iter = 0; iter < 200; ++iter) {
    const int turns = uni(1, 4);
    std::vector<StagedCall> calls;
    std::vector<RouteArray> replies;
    std::vector<std::vector<uint64_t>> generated_versions;
    uint64_t version = uint64_t(uni(0, 3));
    int prev = 0;
    for (int t = 0; t < turns; ++t) {
      const int P = prev + uni(1, 10), T = P + uni(1, 10);
      std::vector<uint64_t> wv;
      for (int i = P; i < T; ++i) {
        if (uni(0, 9) == 0) ++version;  // a refit landed before this token
        wv.push_back(version);
      }
      const RouteArray reply = engine_reply(T, uni(0, 1) ? 0 : std::max(0, prev - 1));
      calls.push_back(stage_call(reply, prev, T, Filler::MinusOne, StagePolicy::Strict, kE, t));
      calls.back().versions = row_versions(wv, prev, T);
      ASSERT_EQ(int(calls.back().versions.size()), T - prev);
      replies.push_back(reply);
      generated_versions.push_back(wv);
      prev = T;
    }
    AssembleReport keep;
    const RouteArray kept = assemble_rollout(calls, replies, true, &keep, VersionPolicy::Keep);
    ASSERT_EQ(int(keep.versions.size()), prev);
    std::vector<uint64_t> want;
    for (const StagedCall& c : calls) want.insert(want.end(), c.versions.begin(), c.versions.end());
    for (size_t t = 1; t < calls.size(); ++t)  // a repaired boundary row: the next call's prefill
      if (replies[t].start <= calls[t].prev_len - 1)
        want[size_t(calls[t].prev_len - 1)] = calls[t].versions.front();
    EXPECT_EQ(keep.versions, want) << "iter " << iter;
    const uint64_t newest = *std::max_element(want.begin(), want.end());
    const bool differ = *std::min_element(want.begin(), want.end()) != newest;
    EXPECT_EQ(keep.mixed_versions, differ);
    mixed += differ;

    AssembleReport drop;
    const RouteArray d = assemble_rollout(calls, replies, true, &drop, VersionPolicy::DropCall);
    int expect_dropped = 0;
    for (const StagedCall& c : calls) {
      bool stale = false;
      for (int p = c.prev_len; p < c.total_len; ++p) stale |= want[size_t(p)] != newest;
      expect_dropped += stale;
      for (int p = c.prev_len; p < c.total_len; ++p)
        for (int i = 0; i < kL * kK; ++i)
          ASSERT_EQ(d.row(p)[i], stale ? int16_t(-1) : kept.row(p)[i])
              << "iter " << iter << " pos " << p;
    }
    EXPECT_EQ(drop.version_dropped_calls, expect_dropped);
    dropped += expect_dropped;

    if (differ) {
      try {
        assemble_rollout(calls, replies, true, nullptr, VersionPolicy::Fail);
        ADD_FAILURE() << "iter " << iter << ": fail did not throw on mixed versions";
      } catch (const Error& e) {
        EXPECT_NE(
            std::string(e.what()).find("span weight versions " +
                                       std::to_string(*std::min_element(want.begin(), want.end())) +
                                       " to " + std::to_string(newest)),
            std::string::npos)
            << e.what();
      }
    } else {
      EXPECT_NO_THROW(assemble_rollout(calls, replies, true, nullptr, VersionPolicy::Fail));
    }
  }
  EXPECT_GT(mixed, 40);  // the sampling exercised both cases
  EXPECT_GT(dropped, 20);
  // Without every call's versions, keep reports none and the other policies refuse.
  std::vector<StagedCall> unknown = {
      stage_call(engine_reply(6, 0), 0, 6, Filler::MinusOne, StagePolicy::Strict, kE)};
  AssembleReport rep;
  assemble_rollout(unknown, {}, false, &rep, VersionPolicy::Keep);
  EXPECT_TRUE(rep.versions.empty());
  EXPECT_THROW(assemble_rollout(unknown, {}, false, nullptr, VersionPolicy::DropCall), Error);
}

TEST(StagingRandom, LenientCorruptCallLeavesOthersIntact) {
  std::mt19937 rng(7);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int iter = 0; iter < 100; ++iter) {
    const int turns = uni(2, 5);
    std::vector<int> lens;
    int T = 0;
    for (int t = 0; t < turns; ++t) lens.push_back(T += uni(2, 15) + uni(1, 15));
    const int bad = uni(0, turns - 1);
    std::vector<StagedCall> calls;
    int prev = 0;
    for (int t = 0; t < turns; ++t) {
      RouteArray r = engine_reply(lens[t], 0);
      if (t == bad) {  // drop the last row: wrong row count
        r.rows -= 1;
        r.data.resize(size_t(r.rows) * kL * kK);
      }
      calls.push_back(stage_call(r, prev, lens[t], Filler::MinusOne, StagePolicy::Lenient, kE, t));
      EXPECT_EQ(calls.back().ok, t != bad);
      prev = lens[t];
    }
    RouteArray all = assemble_rollout(calls, {}, false);
    ASSERT_EQ(all.rows, T);
    for (int t = 0, p = 0; t < turns; ++t)
      for (; p < lens[t]; ++p) {
        if (t == bad || p == lens[t] - 1)
          EXPECT_TRUE(row_is_minus_one(all, p));
        else
          EXPECT_TRUE(row_is_gt(all, p, p)) << iter << " " << p;
      }
  }
}

// ---------------------------------------------------------------------------------------------
// Envelope
// ---------------------------------------------------------------------------------------------

RouteArray small_routes(int16_t max_id) {
  RouteArray r(3, 2, 2);
  const int16_t vals[12] = {0, 1, -1, -1, max_id, 2, 3, 4, 5, 6, 7, 8};
  std::copy(vals, vals + 12, r.data.begin());
  return r;
}

std::string dtype_of(const std::string& env) {
  size_t a = env.find(':'), b = env.find(':', a + 1);
  return env.substr(a + 1, b - a - 1);
}

TEST(EnvelopeCodec, ExactBytesOfTinyArrays) {
  // [1,1,2] = {-1, 5} -> int8 bytes ff 05 -> base64 "/wU=".
  RouteArray a(1, 1, 2);
  a.data = {-1, 5};
  EXPECT_EQ(encode_envelope(a), "nrlre1:int8:1x1x2:/wU=");
  // {128, -1} -> int16 LE bytes 80 00 ff ff -> "gAD//w==".
  RouteArray b(1, 2, 1);
  b.data = {128, -1};
  EXPECT_EQ(encode_envelope(b), "nrlre1:int16:1x2x1:gAD//w==");
  RouteArray back = decode_envelope("nrlre1:int16:1x2x1:gAD//w==");
  EXPECT_EQ(back.rows, 1);
  EXPECT_EQ(back.layers, 2);
  EXPECT_EQ(back.k, 1);
  EXPECT_EQ(back.data, (std::vector<int16_t>{128, -1}));
}

TEST(EnvelopeCodec, NarrowestDtypeAndRoundTrip) {
  struct Case {
    int16_t max_id;
    const char* dtype;
  };
  for (Case c : {Case{127, "int8"}, Case{128, "int16"}, Case{8, "int8"}, Case{255, "int16"},
                 Case{32767, "int16"}}) {
    SCOPED_TRACE(c.max_id);
    RouteArray r = small_routes(c.max_id);
    std::string env = encode_envelope(r);
    EXPECT_EQ(dtype_of(env), c.dtype) << env;
    EXPECT_EQ(env.rfind("nrlre1:", 0), 0u);
    EXPECT_TRUE(contains(env, ":3x2x2:")) << env;
    RouteArray back = decode_envelope(env);
    EXPECT_EQ(back.rows, 3);
    EXPECT_EQ(back.layers, 2);
    EXPECT_EQ(back.k, 2);
    EXPECT_EQ(back.data, r.data);
  }
  EXPECT_STREQ(envelope_dtype_for(-1), "int8");
  EXPECT_STREQ(envelope_dtype_for(127), "int8");
  EXPECT_STREQ(envelope_dtype_for(128), "int16");
  EXPECT_STREQ(envelope_dtype_for(32767), "int16");
  EXPECT_STREQ(envelope_dtype_for(32768), "int32");
  EXPECT_STREQ(envelope_dtype_for(40000), "int32");
  // All -1 (nothing routed) is int8; an empty array round-trips too.
  RouteArray none(4, 2, 3, -1);
  EXPECT_EQ(dtype_of(encode_envelope(none)), "int8");
  EXPECT_EQ(decode_envelope(encode_envelope(none)).data, none.data);
  RouteArray empty(0, 2, 6);
  EXPECT_EQ(encode_envelope(empty), "nrlre1:int8:0x2x6:");
  EXPECT_EQ(decode_envelope("nrlre1:int8:0x2x6:").rows, 0);
}

TEST(EnvelopeCodec, Int32IdsPastInt16) {
  std::vector<int32_t> ids = {40000, -1, 0, 39999, 7, 12};
  std::string env = encode_envelope(ids, 1, 2, 3);
  EXPECT_EQ(dtype_of(env), "int32");
  EnvelopeIds back = decode_envelope_ids(env);
  EXPECT_EQ(back.s, 1);
  EXPECT_EQ(back.l, 2);
  EXPECT_EQ(back.k, 3);
  EXPECT_EQ(back.dtype, "int32");
  EXPECT_EQ(back.data, ids);
  // RouteArray is int16: decoding 40000 into it is an error, not a wrap-around.
  std::string msg = error_of([&] { decode_envelope(env); });
  EXPECT_TRUE(contains(msg, "40000")) << msg;
  // Wider-than-needed dtypes are accepted on decode.
  std::vector<int32_t> small = {1, 2};
  EXPECT_EQ(decode_envelope_ids("nrlre1:int32:1x1x2:AQAAAAIAAAA=").data, small);
  EXPECT_EQ(decode_envelope("nrlre1:int32:1x1x2:AQAAAAIAAAA=").data, (std::vector<int16_t>{1, 2}));
  EXPECT_THROW(encode_envelope(ids, 1, 2, 2), Error);  // shape does not match
  EXPECT_THROW(encode_envelope(std::vector<int32_t>{-2}, 1, 1, 1), Error);
}

TEST(EnvelopeCodec, RejectsMalformed) {
  const std::string good = encode_envelope(small_routes(9));  // nrlre1:int8:3x2x2:<16 chars>
  ASSERT_NO_THROW(decode_envelope(good));
  const std::string payload = good.substr(good.rfind(':') + 1);
  const std::vector<std::string> bad = {
      "",
      "nrlre1",
      "nrlre1:int8:3x2x2",                    // 3 fields
      "nrlre1:int8:3x2x2:" + payload + ":x",  // 5 fields
      "nrlre2:int8:3x2x2:" + payload,         // magic
      "NRLRE1:int8:3x2x2:" + payload,
      "nrlre1:uint8:3x2x2:" + payload,  // dtype
      "nrlre1:int64:3x2x2:" + payload,
      "nrlre1::3x2x2:" + payload,
      "nrlre1:int8:3x2:" + payload,  // shape
      "nrlre1:int8:3x2x2x1:" + payload,
      "nrlre1:int8:3x2x:" + payload,
      "nrlre1:int8:ax2x2:" + payload,
      "nrlre1:int8:-3x2x2:" + payload,
      "nrlre1:int8:+3x2x2:" + payload,
      "nrlre1:int8:03x2x2:" + payload,
      "nrlre1:int8:3 x2x2:" + payload,
      "nrlre1:int8:99999999999x2x2:" + payload,
      "nrlre1:int8:2147483647x2147483647x2147483647:" + payload,
      "nrlre1:int8:4x2x2:" + payload,  // byte count vs shape
      "nrlre1:int8:2x2x2:" + payload,
      "nrlre1:int16:3x2x2:" + payload,
      "nrlre1:int8:3x2x2:" + payload.substr(0, payload.size() - 4),
      "nrlre1:int8:3x2x2:" + payload + "AAAA",
      "nrlre1:int8:3x2x2:!!!!!!!!!!!!!!!!",  // base64
      "nrlre1:int8:3x2x2:" + payload.substr(1),
      "nrlre1:int8:1x1x2:/g==",   // wrong length for 2 bytes
      "nrlre1:int8:1x1x1:/g==",   // id -2 (0xfe)
      "nrlre1:int16:1x1x1:AIA=",  // id -32768
  };
  for (const std::string& s : bad) {
    SCOPED_TRACE(s);
    EXPECT_THROW(decode_envelope(s), Error);
    EXPECT_THROW(decode_envelope_ids(s), Error);
  }
  std::string msg = error_of([] { decode_envelope("nrlre1:int8:4x2x2:AAAA"); });
  EXPECT_TRUE(contains(msg, "needs 16")) << msg;
}

TEST(EnvelopeCodec, RandomRoundTrip) {
  std::mt19937 rng(99);
  for (int iter = 0; iter < 200; ++iter) {
    const int S = int(rng() % 20), L = 1 + int(rng() % 4), K = 1 + int(rng() % 8);
    const int maxes[] = {0, 100, 127, 128, 1000, 32767};
    const int hi = maxes[rng() % 6];
    RouteArray r(S, L, K);
    for (auto& v : r.data) v = int16_t(int(rng() % (hi + 2)) - 1);  // [-1, hi]
    std::string env = encode_envelope(r);
    int16_t mx = r.data.empty() ? -1 : *std::max_element(r.data.begin(), r.data.end());
    EXPECT_EQ(dtype_of(env), envelope_dtype_for(mx));
    RouteArray back = decode_envelope(env);
    ASSERT_EQ(back.data, r.data);
    ASSERT_EQ(back.rows, S);
  }
}

// ---------------------------------------------------------------------------------------------
// Alignment metrics
// ---------------------------------------------------------------------------------------------

// T = 4 tokens, L = 2 MoE layers, K = 2.
//   token  engine            trainer           differing layers
//   0      {1,2} {3,4}       {2,1} {3,4}       0  (same sets, other order)
//   1      {1,2} {3,4}       {1,3} {3,4}       1
//   2      {5,6} {7,0}       {5,7} {7,1}       2
//   3      -1 row            {1,2} {3,4}       skipped (engine has -1)
// Scored tokens 3, pairs 6: differing pairs 3/6 = 0.5, tokens 2/3, mean layers 3/3 = 1.
//
// Logprobs: engine (pi_infer) [-1, -2, -0.5, -3], trainer (pi_train) [-1, -1.5, -1.5, -2],
// d = log r = [0, 0.5, -1, 1].
//   k3 = r - 1 - d: 0; e^0.5 - 1.5 = 0.148721270700; e^-1 - 1 + 1 = 0.367879441171;
//                   e - 2 = 0.718281828459.  Sum 1.234882540330, mean 0.308720635083.
//   max(r, 1/r): 1, 1.6487, 2.7183, 2.7183 -> 2 of 4 above 2 -> 0.5 (threshold 1.5: 3 of 4).
//   |d|: mean (0 + 0.5 + 1 + 1)/4 = 0.625, max 1.
struct SmallCase {
  RouteArray eng{4, 2, 2}, trn{4, 2, 2};
  std::vector<float> lp_eng{-1.0f, -2.0f, -0.5f, -3.0f}, lp_trn{-1.0f, -1.5f, -1.5f, -2.0f};
  SmallCase() {
    eng.data = {1, 2, 3, 4, /**/ 1, 2, 3, 4, /**/ 5, 6, 7, 0, /**/ -1, -1, -1, -1};
    trn.data = {2, 1, 3, 4, /**/ 1, 3, 3, 4, /**/ 5, 7, 7, 1, /**/ 1, 2, 3, 4};
  }
};

TEST(AlignmentCompute, HandComputedSmallCase) {
  SmallCase c;
  AlignmentMetrics m = compute_alignment(c.eng, c.trn, c.lp_eng, c.lp_trn);
  EXPECT_EQ(m.tokens, 4);
  EXPECT_EQ(m.router_tokens, 3);
  EXPECT_EQ(m.skipped_route_rows, 1);
  EXPECT_DOUBLE_EQ(m.router_disagreement_pairs, 0.5);
  EXPECT_DOUBLE_EQ(m.router_disagreement_tokens, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.mean_differing_layers, 1.0);
  EXPECT_NEAR(m.k3_kl, 0.308720635083, 1e-11);
  EXPECT_DOUBLE_EQ(m.extreme_token_fraction, 0.5);
  EXPECT_DOUBLE_EQ(m.mean_abs_dlogprob, 0.625);
  EXPECT_DOUBLE_EQ(m.max_abs_dlogprob, 1.0);
  AlignmentMetrics m15 = compute_alignment(c.eng, c.trn, c.lp_eng, c.lp_trn, 1.5);
  EXPECT_DOUBLE_EQ(m15.extreme_token_fraction, 0.75);
}

TEST(AlignmentCompute, PartlyMinusOneRowIsSkippedToo) {
  SmallCase c;
  c.trn.at(0, 1, 1) = -1;  // token 0 now has a -1 in the trainer array
  AlignmentMetrics m = compute_alignment(c.eng, c.trn, c.lp_eng, c.lp_trn);
  // Scored tokens 1, 2: differing pairs 3 of 4 -> 0.75; tokens 2/2; mean 3/2.
  EXPECT_EQ(m.router_tokens, 2);
  EXPECT_EQ(m.skipped_route_rows, 2);
  EXPECT_DOUBLE_EQ(m.router_disagreement_pairs, 0.75);
  EXPECT_DOUBLE_EQ(m.router_disagreement_tokens, 1.0);
  EXPECT_DOUBLE_EQ(m.mean_differing_layers, 1.5);
  EXPECT_EQ(m.tokens, 4);  // logprob metrics still over all 4
  EXPECT_DOUBLE_EQ(m.mean_abs_dlogprob, 0.625);
}

TEST(AlignmentCompute, IdenticalInputsAreZero) {
  SmallCase c;
  AlignmentMetrics m = compute_alignment(c.trn, c.trn, c.lp_eng, c.lp_eng);
  EXPECT_EQ(m.router_tokens, 4);
  EXPECT_EQ(m.router_disagreement_pairs, 0.0);
  EXPECT_EQ(m.router_disagreement_tokens, 0.0);
  EXPECT_EQ(m.mean_differing_layers, 0.0);
  EXPECT_EQ(m.k3_kl, 0.0);
  EXPECT_EQ(m.extreme_token_fraction, 0.0);
  EXPECT_EQ(m.max_abs_dlogprob, 0.0);
  // No tokens at all: everything 0.
  AlignmentMetrics z = compute_alignment(RouteArray(0, 2, 2), RouteArray(0, 2, 2), {}, {});
  EXPECT_EQ(z.tokens, 0);
  EXPECT_EQ(z.k3_kl, 0.0);
  // Every row skipped: router fractions 0, logprob metrics still computed.
  RouteArray none(4, 2, 2, -1);
  AlignmentMetrics s = compute_alignment(none, c.trn, c.lp_eng, c.lp_trn);
  EXPECT_EQ(s.router_tokens, 0);
  EXPECT_EQ(s.skipped_route_rows, 4);
  EXPECT_EQ(s.router_disagreement_pairs, 0.0);
  EXPECT_DOUBLE_EQ(s.mean_abs_dlogprob, 0.625);
}

TEST(AlignmentCompute, RejectsMismatchedInputs) {
  SmallCase c;
  EXPECT_THROW(compute_alignment(c.eng, RouteArray(4, 2, 3), c.lp_eng, c.lp_trn), Error);
  EXPECT_THROW(compute_alignment(c.eng, RouteArray(3, 2, 2), c.lp_eng, c.lp_trn), Error);
  EXPECT_THROW(compute_alignment(c.eng, c.trn, c.lp_eng, std::vector<float>{-1, -2, -3}), Error);
  EXPECT_THROW(compute_alignment(RouteArray(3, 2, 2), RouteArray(3, 2, 2), c.lp_eng, c.lp_trn),
               Error);
  std::vector<float> nan_lp = c.lp_trn;
  nan_lp[2] = std::nanf("");
  EXPECT_THROW(compute_alignment(c.eng, c.trn, c.lp_eng, nan_lp), Error);
  EXPECT_THROW(abs_dlogprobs(c.lp_eng, std::vector<float>{1}), Error);
}

TEST(AlignmentCompute, JsonKeysExactly) {
  SmallCase c;
  nlohmann::json j = to_json(compute_alignment(c.eng, c.trn, c.lp_eng, c.lp_trn));
  std::set<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.insert(it.key());
  EXPECT_EQ(keys, (std::set<std::string>{"tokens", "router_disagreement_pairs",
                                         "router_disagreement_tokens", "mean_differing_layers",
                                         "k3_kl", "extreme_token_fraction", "mean_abs_dlogprob",
                                         "max_abs_dlogprob"}));
  EXPECT_EQ(j["tokens"].get<int>(), 4);
  EXPECT_DOUBLE_EQ(j["router_disagreement_pairs"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(j["mean_abs_dlogprob"].get<double>(), 0.625);
}

TEST(AlignmentCompute, AbsDlogprobs) {
  SmallCase c;
  EXPECT_EQ(abs_dlogprobs(c.lp_eng, c.lp_trn), (std::vector<double>{0.0, 0.5, 1.0, 1.0}));
}

TEST(AlignmentSvg, HistogramHasBothSeriesLegendAndAxes) {
  std::mt19937 rng(3);
  std::lognormal_distribution<double> without(std::log(3e-2), 1.0), with(std::log(3e-4), 1.0);
  std::vector<double> a, b;
  for (int i = 0; i < 500; ++i) a.push_back(without(rng));
  for (int i = 0; i < 500; ++i) b.push_back(with(rng));
  b.push_back(0.0);  // exact zeros land in the leftmost bin
  std::string svg = dlogprob_histogram_svg(a, b);
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_TRUE(contains(svg, "</svg>"));
  EXPECT_TRUE(contains(svg, "without replay (n=500"));
  EXPECT_TRUE(contains(svg, "with replay (n=501"));
  EXPECT_TRUE(contains(svg, "fraction of tokens"));
  EXPECT_TRUE(contains(svg, "logprob|"));
  EXPECT_TRUE(contains(svg, "log-scaled bins"));
  EXPECT_TRUE(contains(svg, ">1e-3<"));  // decade ticks
  EXPECT_TRUE(contains(svg, ">1e-2<"));
  EXPECT_TRUE(contains(svg, "#d62728") && contains(svg, "#1f77b4"));
  // Balanced tags: every opened element is closed.
  auto count = [&](const std::string& s) {
    size_t n = 0;
    for (size_t p = svg.find(s); p != std::string::npos; p = svg.find(s, p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("<text"), count("</text>"));
  EXPECT_EQ(count("<g "), count("</g>"));
  EXPECT_GT(count("<rect"), 10u);
  if (const char* dir = std::getenv("R3_TEST_OUTPUT_DIR")) {
    std::ofstream(std::string(dir) + "/dlogprob_histogram.svg") << svg;
  }
}

TEST(AlignmentSvg, EmptyAndDegenerateInputs) {
  std::string svg = dlogprob_histogram_svg({}, {});
  EXPECT_TRUE(contains(svg, "no data"));
  EXPECT_TRUE(contains(svg, "</svg>"));
  svg = dlogprob_histogram_svg({0.0, 0.0}, {NAN, INFINITY, 0.5});
  EXPECT_TRUE(contains(svg, "without replay (n=2"));
  EXPECT_TRUE(contains(svg, "with replay (n=1"));
  EXPECT_FALSE(contains(svg, "mean nan") || contains(svg, "mean inf"));
}

// The spread filler: forced ids, distinct within a layer, in range, and varying with the position
// and the layer, so padding rows do not all land on one expert.
TEST(StagingCall, SpreadFillerVariesAcrossTokensAndLayers) {
  std::set<int> firsts;
  for (int T : {7, 8, 9, 24}) {
    RouteArray r = engine_reply(T, 0);
    StagedCall c = stage_call(r, 0, T, Filler::Spread, StagePolicy::Strict, kE, 1);
    ASSERT_EQ(c.filler_rows, 1);
    for (int l = 0; l < kL; ++l) {
      std::set<int> ids;
      for (int j = 0; j < kK; ++j) {
        const int id = c.rows.at(T - 1, l, j);
        EXPECT_GE(id, 0);
        EXPECT_LT(id, kE);
        ids.insert(id);
      }
      EXPECT_EQ(int(ids.size()), kK) << "distinct within a layer";
      firsts.insert(c.rows.at(T - 1, l, 0));
    }
  }
  EXPECT_GT(firsts.size(), 4u) << "the ids move with the position and the layer";
  EXPECT_EQ(parse_filler("spread"), Filler::Spread);
  EXPECT_THROW(parse_filler("zeros"), Error);
}

}  // namespace
}  // namespace r3
