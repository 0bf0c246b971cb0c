// Router Replay correctness table (RFC §4.4), one test per row that would catch the bug it names.
#include <gtest/gtest.h>

#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include "core/error.h"
#include "engine_test_util.h"
#include "kernels/router.h"
#include "model/checkpoint.h"
#include "reference/reference_forward.h"
#include "routes/route_manager.h"
#include "test_models.h"

namespace r3::testing {
namespace {

EngineConfig routes_config(const std::string& model) {
  EngineConfig c;
  c.model = model;
  c.enable_return_routed_experts = true;
  c.num_kv_blocks = 64;
  return c;
}

void expect_valid_routes(const RouteArray& r, int rows, const ModelConfig& mc) {
  ASSERT_EQ(r.rows, rows);
  ASSERT_EQ(r.layers, mc.num_moe_layers());
  ASSERT_EQ(r.k, mc.top_k);
  for (int i = 0; i < r.rows; ++i)
    for (int l = 0; l < r.layers; ++l)
      for (int j = 0; j < r.k; ++j) {
        ASSERT_GE(r.at(i, l, j), 0);
        ASSERT_LT(r.at(i, l, j), mc.num_experts);
        for (int j2 = 0; j2 < j; ++j2) ASSERT_NE(r.at(i, l, j), r.at(i, l, j2));
      }
}

// Off-by-one: exactly S-1 rows, for max_tokens=1, a one-token prompt, and a stop on the first
// generated token.
TEST(EngineRoutes, ExactlySMinusOneRows) {
  Engine e(routes_config(test_model("qwen3_moe")));
  const ModelConfig& mc = e.model_config();
  auto o = e.generate({{5}}, {greedy(1)})[0];
  ASSERT_EQ(o.token_ids.size(), 1u);
  expect_valid_routes(*o.routed_experts, 1, mc);  // S = 2
  o = e.generate({{5, 6, 7}}, {greedy(4)})[0];
  expect_valid_routes(*o.routed_experts, 3 + 4 - 1, mc);
  // Stop on the first generated token: make the greedy token a stop token.
  const int first = o.token_ids[0];
  SamplingParams p = greedy(10);
  p.stop_token_ids = {first};
  auto s = e.generate({{5, 6, 7}}, {p})[0];
  EXPECT_EQ(s.finish_reason, "stop");
  ASSERT_EQ(s.token_ids.size(), 1u);
  expect_valid_routes(*s.routed_experts, 3, mc);
  // The rows are the same rows the longer run computed for those positions.
  for (int r = 0; r < 3; ++r)
    for (int j = 0; j < mc.num_moe_layers() * mc.top_k; ++j)
      EXPECT_EQ(s.routed_experts->row(r)[j], o.routed_experts->row(r)[j]);
}

// Delta start N returns rows [N, S-1) equal to the full run's.
TEST(EngineRoutes, DeltaStartReturnsTheTail) {
  Engine e(routes_config(test_model("olmoe")));
  auto full = e.generate({{9, 8, 7, 6, 5}}, {greedy(6)})[0];
  SamplingParams p = greedy(6);
  p.routed_experts_start = 4;
  auto d = e.generate({{9, 8, 7, 6, 5}}, {p})[0];
  ASSERT_EQ(d.routed_experts->start, 4);
  ASSERT_EQ(d.routed_experts->rows, full.routed_experts->rows - 4);
  for (int r = 0; r < d.routed_experts->rows; ++r)
    for (int j = 0; j < d.routed_experts->layers * d.routed_experts->k; ++j)
      EXPECT_EQ(d.routed_experts->row(r)[j], full.routed_experts->row(r + 4)[j]);
}

// Opt-in twice: a request asking an engine started without capture is an error.
TEST(EngineRoutes, AskingWithoutEngineOptionIsAnError) {
  EngineConfig c = routes_config(test_model("mixtral"));
  c.enable_return_routed_experts = false;
  Engine e(c);
  try {
    e.add_request({1, 2, 3}, greedy(2));
    FAIL() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("enable_return_routed_experts"), std::string::npos);
  }
  // Without the option, requests without routes work and carry none.
  auto o = e.generate({{1, 2, 3}}, {greedy(2, false)})[0];
  EXPECT_FALSE(o.routed_experts.has_value());
}

TEST(EngineRoutes, BadRequestsAreClearErrors) {
  Engine e(routes_config(test_model("mixtral")));
  // Each refusal says what was wrong and names the field it concerns (FieldError::field).
  auto expect_error = [&](std::vector<int> prompt, SamplingParams p, const char* needle,
                          const char* field) {
    try {
      e.add_request(prompt, p);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const FieldError& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
      EXPECT_EQ(err.field(), field) << err.what();
    }
  };
  expect_error({1, 512}, greedy(2), "outside the vocabulary", "prompt");
  expect_error({-1}, greedy(2), "outside the vocabulary", "prompt");
  expect_error({}, greedy(2), "empty", "prompt");
  expect_error(std::vector<int>(4000, 1), greedy(200), "positions", "prompt");
  expect_error(std::vector<int>(2000, 1), greedy(2), "KV blocks", "prompt");
  SamplingParams bad = greedy(0);
  expect_error({1}, bad, "max_tokens", "max_tokens");
  bad = greedy(2);
  bad.top_p = 0.f;
  expect_error({1}, bad, "top_p", "top_p");
  bad = greedy(2);
  bad.routed_experts_start = 50;
  expect_error({1}, bad, "routed_experts_start", "routed_experts_start");
  bad = greedy(2);
  bad.prompt_logprobs_start = 3;
  expect_error({1, 2}, bad, "past the prompt", "prompt_logprobs_start");
  bad = greedy(2);
  bad.stop = {"x"};
  expect_error({1}, bad, "need a tokenizer", "stop");
  // Nothing was lost: the engine still serves.
  EXPECT_EQ(e.generate({{1, 2}}, {greedy(2)})[0].token_ids.size(), 2u);
}

// Overlap scheduling: a request that stops (stop token) in the step it was scheduled gets the
// same tokens and routes as with overlap off, and nothing from the wasted step.
TEST(EngineRoutes, OverlapStopInScheduledStep) {
  const std::string model = test_model("olmoe");
  Engine probe(routes_config(model));
  auto ref = probe.generate({{4, 5, 6, 7}}, {greedy(8)})[0];
  SamplingParams p = greedy(8);
  p.stop_token_ids = {ref.token_ids[2]};
  for (bool overlap : {false, true}) {
    EngineConfig c = routes_config(model);
    c.overlap_scheduler = overlap;
    Engine e(c);
    auto outs = e.generate({{4, 5, 6, 7}, {9, 9, 9}}, {p, greedy(12)});
    EXPECT_EQ(outs[0].finish_reason, "stop");
    ASSERT_EQ(outs[0].token_ids.size(), 3u);
    ASSERT_EQ(outs[0].routed_experts->rows, 4 + 3 - 1);
    for (int r = 0; r < outs[0].routed_experts->rows; ++r)
      for (int j = 0; j < outs[0].routed_experts->layers * outs[0].routed_experts->k; ++j)
        EXPECT_EQ(outs[0].routed_experts->row(r)[j], ref.routed_experts->row(r)[j]);
    EXPECT_EQ(e.stats().routed_experts_gaps, 0u);
  }
}

// Bucketed decode: padding rows are never attributed (a bucket of 8 for 3 requests).
TEST(EngineRoutes, PaddingNeverAttributed) {
  const std::string model = test_model("mixtral");
  EngineConfig c = routes_config(model);
  c.decode_buckets = {8};
  Engine e(c);
  std::vector<std::vector<int>> prompts = {{1, 2, 3}, {4, 5}, {6}};
  auto outs = e.generate(prompts, {greedy(5)});
  EXPECT_GT(e.stats().padded_tokens, 0u);
  Engine solo(solo_config(model));
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto s = solo.generate({prompts[i]}, {greedy(5)})[0];
    expect_matches_solo(outs[i], s, false, greedy(5), "request " + std::to_string(i));
  }
  EXPECT_EQ(e.stats().route_rows_committed,
            uint64_t((3 + 5 - 1) + (2 + 5 - 1) + (1 + 5 - 1)) + 0u * 1);
}

// Block reuse: a block freed and reused while an older step's commit is pending never yields the
// older content's routes. The route manager only copies rows stamped with the generation the
// hitting request saw; anything else is stale and never copied.
TEST(EngineRoutes, GenerationStampsRejectReusedBlocks) {
  RouteManager m(1, 2, 4, 2);
  CaptureSlot slot;
  slot.max_tokens = 4;
  slot.layers = 1;
  slot.k = 2;
  slot.data = {3, 4, 5, 6, 0, 0, 0, 0};
  slot.weights = {0.75f, 0.25f, 0.5f, 0.5f, 0.f, 0.f, 0.f, 0.f};
  // Step 0: request 7 writes positions 0,1 into block 2 under generation 1.
  StepPlan p0;
  p0.iter = 0;
  PlannedSeq s0;
  s0.request_id = 7;
  s0.num_tokens = 2;
  s0.table_len = 1;
  p0.block_tables = {2};
  p0.seqs.push_back(s0);
  p0.tokens.push_back({0, 0, 1, 2, 1, 0});
  p0.tokens.push_back({0, 1, 1, 2, 1, 1});
  m.commit(p0, slot);
  // Request 8 hits block 2, but the block was reused (generation 2) before its first commit.
  m.open(8, 4);
  StepPlan p1;
  p1.iter = 1;
  PlannedSeq s1;
  s1.request_id = 8;
  s1.num_tokens = 1;
  s1.start_pos = 2;
  s1.table_len = 2;
  p1.block_tables = {2, 3};
  s1.prefix_hit_tokens = 2;
  p1.hit_generations = {2};
  p1.seqs.push_back(s1);
  p1.tokens.push_back({0, 2, 1, 3, 1, 0});
  m.commit(p1, slot);
  EXPECT_EQ(m.stats().prefix_rows_copied, 0u);
  EXPECT_EQ(m.stats().stale_prefix_rows, 2u);
  uint64_t gaps = 0;
  RouteArray r = m.assemble(8, 4, 0, &gaps);
  EXPECT_EQ(gaps, 2u);  // the stale rows are -1 and counted, never the old content
  EXPECT_EQ(r.at(0, 0, 0), -1);
  EXPECT_EQ(r.at(2, 0, 0), 3);
  // With the matching generation the rows are copied, with their gate weights when asked for.
  m.open(9, 4, /*with_weights=*/true);
  StepPlan p2 = p1;
  p2.iter = 2;
  p2.seqs[0].request_id = 9;
  p2.hit_generations = {1};
  // Block 2 was rewritten by p1? No: p1 wrote block 3 only; block 2 still holds generation 1.
  m.commit(p2, slot);
  EXPECT_EQ(m.stats().prefix_rows_copied, 2u);
  const RouteArray w = m.assemble(9, 4, 0, &gaps);
  EXPECT_EQ(gaps, 0u);
  EXPECT_EQ(w.data, (std::vector<int16_t>{3, 4, 5, 6, 3, 4}));
  EXPECT_EQ(w.weights, (std::vector<float>{0.75f, 0.25f, 0.5f, 0.5f, 0.75f, 0.25f}));
  EXPECT_FALSE(r.has_weights());  // request 8 did not ask
  // Commits must come in iter order.
  EXPECT_THROW(m.commit(p1, slot), Error);
}

// Refit: after update_weights with flush, a previously cached prompt gets the new weights'
// routes and tokens, and outputs report the version of each token.
TEST(EngineRoutes, RefitWithFlushGivesNewWeightsRoutes) {
  const std::string a = test_model("qwen3_moe", "tiny", 0), b = test_model("qwen3_moe", "tiny", 1);
  std::vector<int> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[size_t(i)] = 3 + (i * 37) % 500;
  Engine e(routes_config(a));
  auto before = e.generate({prompt}, {greedy(4)})[0];
  EXPECT_EQ(before.weight_versions, std::vector<uint64_t>(4, 0));
  e.update_weights(b, /*flush_prefix_cache=*/true);
  const uint64_t hits_before = e.stats().prefix_hit_tokens;
  auto after = e.generate({prompt}, {greedy(4)})[0];
  EXPECT_EQ(e.stats().prefix_hit_tokens, hits_before);  // nothing reached the old KV
  EXPECT_EQ(after.weight_versions, std::vector<uint64_t>(4, 1));
  Engine solo_b(solo_config(b));
  auto want = solo_b.generate({prompt}, {greedy(4)})[0];
  expect_matches_solo(after, want, false, greedy(4), "after refit");
  // Without flush the old blocks stay cached, but prefix chains start from the weight version:
  // nothing computed under version 0 is reused under version 1 (issue 48), and the output is
  // still the new weights' solo run.
  Engine e2(routes_config(a));
  e2.generate({prompt}, {greedy(4)});
  e2.update_weights(b, false);
  const uint64_t h2 = e2.stats().prefix_hit_tokens;
  auto kept = e2.generate({prompt}, {greedy(4)})[0];
  EXPECT_EQ(e2.stats().prefix_hit_tokens, h2);
  expect_matches_solo(kept, want, false, greedy(4), "after refit without flush");
}

// Refit between the steps of a running request: tokens report the version that produced them.
TEST(EngineRoutes, VersionPerTokenAcrossRefit) {
  const std::string a = test_model("olmoe", "tiny", 0), b = test_model("olmoe", "tiny", 1);
  Engine e(routes_config(a));
  uint64_t id = e.add_request({1, 2, 3}, greedy(6));
  std::optional<RequestOutput> done;
  int steps = 0;
  while (!done) {
    if (steps++ == 3) e.update_weights(b, true);
    for (auto& o : e.step())
      if (o.finished && o.request_id == id) done = o;
  }
  ASSERT_EQ(done->weight_versions.size(), 6u);
  EXPECT_EQ(done->weight_versions.front(), 0u);
  EXPECT_EQ(done->weight_versions.back(), 1u);
  EXPECT_TRUE(std::is_sorted(done->weight_versions.begin(), done->weight_versions.end()));
}

// Abort mid-generation: no crash, no leak, the rows computed so far, others unaffected.
TEST(EngineRoutes, AbortMidGeneration) {
  const std::string model = test_model("mixtral");
  EngineConfig c = routes_config(model);
  c.overlap_scheduler = true;
  Engine e(c);
  uint64_t a = e.add_request({1, 2, 3, 4}, greedy(30));
  uint64_t b = e.add_request({5, 6, 7}, greedy(10));
  std::map<uint64_t, RequestOutput> done;
  int steps = 0;
  while (e.has_unfinished()) {
    if (++steps == 5) {
      EXPECT_TRUE(e.abort(a));
    }
    for (auto& o : e.step())
      if (o.finished) done[o.request_id] = o;
  }
  EXPECT_EQ(done[a].finish_reason, "abort");
  EXPECT_LT(done[a].token_ids.size(), 30u);
  const int S = int(4 + done[a].token_ids.size());
  ASSERT_TRUE(done[a].routed_experts);
  EXPECT_GE(done[a].routed_experts->rows, S - 2);
  EXPECT_LE(done[a].routed_experts->rows, S - 1);
  Engine solo(solo_config(model));
  expect_matches_solo(done[b], solo.generate({{5, 6, 7}}, {greedy(10)})[0], false, greedy(10), "b");
  expect_matches_solo(done[a], solo.generate({{1, 2, 3, 4}}, {greedy(30)})[0], true, greedy(30),
                      "a");
  EXPECT_EQ(e.stats().free_blocks, e.stats().num_blocks);
  EXPECT_FALSE(e.abort(a));  // already finished
}

// An aborted request honours routed_experts_start: its rows begin at the asked position and
// equal the solo run's rows there.
TEST(EngineRoutes, AbortKeepsRoutedExpertsStart) {
  const std::string model = test_model("mixtral");
  Engine e(routes_config(model));
  SamplingParams p = greedy(30);
  p.routed_experts_start = 6;
  uint64_t a = e.add_request({1, 2, 3, 4, 5, 6, 7, 8}, p);
  std::optional<RequestOutput> done;
  for (int steps = 0; e.has_unfinished(); ++steps) {
    if (steps == 6) {
      EXPECT_TRUE(e.abort(a));
    }
    for (auto& o : e.step())
      if (o.finished) done = o;
  }
  ASSERT_TRUE(done && done->routed_experts);
  EXPECT_EQ(done->finish_reason, "abort");
  const RouteArray& got = *done->routed_experts;
  EXPECT_EQ(got.start, 6);
  const int S = int(8 + done->token_ids.size());
  EXPECT_GE(got.rows, S - 2 - 6);
  EXPECT_LE(got.rows, S - 1 - 6);
  Engine solo(solo_config(model));
  SamplingParams full = greedy(30);
  full.return_routed_experts = true;
  const RouteArray want = *solo.generate({{1, 2, 3, 4, 5, 6, 7, 8}}, {full})[0].routed_experts;
  for (int r = 0; r < got.rows; ++r)
    for (int i = 0; i < got.layers * got.k; ++i)
      ASSERT_EQ(got.row(r)[i], want.row(r + 6)[i]) << "row " << r;
}

// The partial-rollout contract (asynchronous RL aborts rollouts at a weight update and resumes
// them): an aborted request returns what it generated (tokens, logprobs, the computed route rows
// [start, cut)); resuming it as a new request whose prompt is prompt + partial tokens, with the
// same seed, max_tokens less what came, and routed_experts_start at the cut, continues exactly as
// the uninterrupted run (tokens, logprobs and routes bit for bit), because sampling draws from
// (seed, absolute position). Seeded: random prompts, lengths and abort steps (mid-prefill with a
// small token budget, mid-decode, or after the end), other requests running beside it, overlap
// scheduling on and off, and in a third of the trials a refit landing before the abort (the same
// weights reloaded, so the bits must still match while the versions mark the change).
TEST(EngineRoutes, AnAbortedRequestResumesExactlyAsTheUninterruptedRun) {
  const std::string model = test_model("olmoe");
  Engine solo(solo_config(model));
  std::mt19937 rng(45);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int mid_prefill = 0, mid_decode = 0, across_refit = 0, by_bucket_refit = 0;
  // The model's own tensors, sent back in two buckets: a refit from memory that changes no value.
  std::vector<TensorToWrite> own = read_safetensors(model + "/model.safetensors");
  const std::vector<TensorToWrite> bucket1(own.begin(), own.begin() + ptrdiff_t(own.size() / 2)),
      bucket2(own.begin() + ptrdiff_t(own.size() / 2), own.end());
  for (int trial = 0; trial < 18; ++trial) {
    EngineConfig c = routes_config(model);
    c.max_num_batched_tokens =
        16;  // a long prompt takes several steps: aborts can land mid-prefill
    c.overlap_scheduler = trial % 2 == 1;
    Engine e(c);
    std::vector<int> prompt(size_t(uni(3, 60)));
    for (int& t : prompt) t = uni(3, 250);
    SamplingParams p;
    p.max_tokens = uni(2, 24);
    p.temperature = 0.8f;
    p.seed = uint64_t(1000 + trial);
    p.ignore_eos = true;
    p.return_routed_experts = true;
    const std::string what =
        "trial " + std::to_string(trial) + " P " + std::to_string(prompt.size());
    const RequestOutput full = solo.generate({prompt}, {p})[0];

    const uint64_t id = e.add_request(prompt, p);
    e.add_request({7, 8, 9, 10, 11}, greedy(uni(1, 30)));  // company in the batch
    std::optional<RequestOutput> cut;
    const int abort_at = uni(0, 12);
    // Every third trial a refit from disk lands before the abort; every third after it, the abort
    // is a refit from memory beginning (its first bucket ends the running requests).
    const int refit_at = trial % 3 == 2 ? uni(0, abort_at) : -1;
    const bool bucket_abort = trial % 3 == 1;
    bool refitted_in_buckets = false;
    for (int step = 0; e.has_unfinished(); ++step) {
      if (step == refit_at) e.update_weights(model, false);
      if (step == abort_at && bucket_abort) {
        e.stage_weights(bucket1);
        for (RequestOutput& o : e.apply_aborts())
          if (o.request_id == id && o.finished) cut = std::move(o);
        e.stage_weights(bucket2);
        e.commit_staged_weights(false);
        refitted_in_buckets = true;
      } else if (step == abort_at) {
        e.abort(id);
      }
      for (RequestOutput& o : e.step())
        if (o.request_id == id && o.finished) cut = std::move(o);
    }
    ASSERT_TRUE(cut && cut->routed_experts) << what;
    if (cut->finish_reason != "abort") {  // it ended before the abort landed: the whole run
      expect_matches_solo(*cut, full, false, p, what);
      continue;
    }
    const int m = int(cut->token_ids.size());
    const RouteArray& first = *cut->routed_experts;
    (m == 0 ? mid_prefill : mid_decode)++;
    by_bucket_refit += refitted_in_buckets;
    for (int i = 0; i < m; ++i) {
      ASSERT_EQ(cut->token_ids[size_t(i)], full.token_ids[size_t(i)]) << what << " token " << i;
      ASSERT_EQ(cut->logprobs[size_t(i)], full.logprobs[size_t(i)]) << what << " token " << i;
    }
    std::vector<int> resumed_prompt = prompt;
    resumed_prompt.insert(resumed_prompt.end(), cut->token_ids.begin(), cut->token_ids.end());
    SamplingParams q = p;
    q.max_tokens = p.max_tokens - m;
    q.routed_experts_start = first.start + first.rows;  // the first row not returned
    const RequestOutput rest = e.generate({resumed_prompt}, {q})[0];
    std::vector<int> tokens = cut->token_ids;
    tokens.insert(tokens.end(), rest.token_ids.begin(), rest.token_ids.end());
    std::vector<float> logprobs = cut->logprobs;
    logprobs.insert(logprobs.end(), rest.logprobs.begin(), rest.logprobs.end());
    EXPECT_EQ(tokens, full.token_ids) << what;
    EXPECT_EQ(logprobs, full.logprobs) << what;
    std::vector<int16_t> rows = first.data;
    rows.insert(rows.end(), rest.routed_experts->data.begin(), rest.routed_experts->data.end());
    EXPECT_EQ(rows, full.routed_experts->data)
        << what << " (cut at row " << q.routed_experts_start << ")";
    // The versions say which weights made each token: the refit's counter from the step it landed.
    std::vector<uint64_t> versions = cut->weight_versions;
    versions.insert(versions.end(), rest.weight_versions.begin(), rest.weight_versions.end());
    EXPECT_TRUE(std::is_sorted(versions.begin(), versions.end())) << what;
    EXPECT_EQ(versions.back(), refit_at >= 0 || refitted_in_buckets ? 1u : 0u) << what;
    if (refit_at >= 0 && versions.front() == 0) ++across_refit;
  }
  EXPECT_GT(mid_prefill,
            0);  // the sampling reached both kinds of abort, and a rollout across a refit
  EXPECT_GT(mid_decode, 2);
  EXPECT_GT(across_refit, 0);
  EXPECT_GT(by_bucket_refit, 1);
}

// EPLB: routes and outputs identical on and off, logical ids only; replicas really ran.
TEST(EngineRoutes, EplbIdenticalAndLogical) {
  const std::string model = test_model("olmoe");
  Workload w = make_workload(77, 12, 512);
  EngineConfig off = routes_config(model);
  off.max_num_batched_tokens = 32;
  EngineConfig on = off;
  on.eplb_redundant_experts = 4;
  RunResult r_off = run_workload(off, w), r_on = run_workload(on, w);
  for (size_t i = 0; i < w.prompts.size(); ++i)
    expect_matches_solo(r_on.outputs[i], r_off.outputs[i], false, w.params[i],
                        "request " + std::to_string(i));
  // The replicas really ran: some tokens went to physical ids past the logical range, while
  // the logical load (what routes report) is the same with EPLB on and off.
  uint64_t replica_tokens = 0;
  for (auto& layer : r_on.stats.physical_expert_load)
    for (size_t p = 8; p < layer.size(); ++p) replica_tokens += layer[p];
  EXPECT_GT(replica_tokens, 0u);
  EXPECT_EQ(r_on.stats.expert_load, r_off.stats.expert_load);
}

// Against the reference forward: every routing disagreement is a near-tie in the reference's
// router scores (with the engine's routes replayed up to it); with the engine's routes replayed,
// greedy tokens equal the reference's (except at near-ties of the logits) and logprobs agree within
// 0.05 (bf16 activations vs fp32), with the KV cache in bf16 (the default for these bf16
// checkpoints) and in fp32.
class EngineVsReference
    : public ::testing::TestWithParam<std::tuple<std::string, std::string, std::string>> {};

// The experts MoE column `col` picks from the reference's scores `probs` (sorted ids), and how
// close that choice was to going another way: the gap between the K-th and (K+1)-th score; for
// sigmoid routers on the biased scores among the experts of the kept groups, and also between
// the last kept and the first dropped group (per expert: a group's score sums two).
struct RouterChoice {
  std::vector<int> experts;
  float margin = 1e30f;
};
RouterChoice reference_choice(const ModelWeights& w, int col, const float* probs) {
  const ModelConfig& c = w.config;
  const int E = c.num_experts, K = c.top_k;
  std::vector<std::pair<float, int>> eligible;  // (score used for the choice, expert)
  RouterChoice out;
  if (c.router.scoring == RouterScoring::Sigmoid) {
    const LayerWeights& L = w.layers[size_t(c.moe_layers()[size_t(col)])];
    std::vector<float> score(probs, probs + E);
    for (int e = 0; e < E; ++e) score[size_t(e)] += L.router_bias.at(e);
    const int G = c.router.n_group, per = E / G;
    std::vector<std::pair<float, int>> groups;
    for (int g = 0; g < G; ++g) {
      std::vector<float> m(score.begin() + g * per, score.begin() + (g + 1) * per);
      std::sort(m.rbegin(), m.rend());
      groups.push_back({m[0] + m[1], g});
    }
    std::stable_sort(groups.begin(), groups.end(),
                     [](auto a, auto b) { return a.first > b.first; });
    if (G > 1)
      out.margin = (groups[size_t(c.router.topk_group - 1)].first -
                    groups[size_t(c.router.topk_group)].first) /
                   2;
    for (int k = 0; k < (G > 1 ? c.router.topk_group : 1); ++k)
      for (int e = 0; e < per; ++e) {
        const int id = groups[size_t(k)].second * per + e;
        eligible.push_back({score[size_t(id)], id});
      }
  } else {
    for (int e = 0; e < E; ++e) eligible.push_back({probs[e], e});
  }
  std::stable_sort(eligible.begin(), eligible.end(),
                   [](auto a, auto b) { return a.first > b.first; });
  if (int(eligible.size()) > K)
    out.margin = std::min(out.margin, eligible[size_t(K - 1)].first - eligible[size_t(K)].first);
  for (int k = 0; k < K; ++k) out.experts.push_back(eligible[size_t(k)].second);
  std::sort(out.experts.begin(), out.experts.end());
  return out;
}

TEST_P(EngineVsReference, TokensLogprobsAndRoutes) {
  const auto [arch, preset, kv_dtype] = GetParam();
  const std::string model = test_model(arch, preset);
  EngineConfig cfg = routes_config(model);
  cfg.kv_cache_dtype = kv_dtype;
  Engine e(cfg);
  ASSERT_EQ(e.config().kv_cache_dtype, kv_dtype);
  auto ck = Checkpoint::open(model);
  const ModelConfig& mc = ck->config();
  Workload w = make_workload(5, 6, mc.vocab_size);
  int pairs = 0, agree = 0, agree_given_history = 0, tokens = 0, token_agree = 0;
  double max_dlogprob = 0, max_dweight = 0;
  for (size_t i = 0; i < w.prompts.size(); ++i) {
    SamplingParams sp = greedy(12);
    sp.return_routed_expert_weights = true;
    auto o = e.generate({w.prompts[i]}, {sp})[0];
    std::vector<int> seq = o.prompt_token_ids;
    seq.insert(seq.end(), o.token_ids.begin(), o.token_ids.end());
    ReferenceResult ref = reference_forward(ck->weights(), seq);
    // Logprobs and greedy tokens are compared with the engine's routes replayed, so a routing
    // near-tie (which legitimately flips an expert) does not hide a numerics bug or excuse one.
    const RouteArray& er = *o.routed_experts;
    ReferenceResult rep = reference_forward(ck->weights(), seq, er.data.data(), er.rows);
    const int P = int(o.prompt_token_ids.size());
    for (size_t g = 0; g < o.token_ids.size(); ++g) {
      const int pos = P + int(g) - 1;  // logits at pos predict token P + g
      std::vector<float> lp =
          log_softmax(rep.logits.data() + size_t(pos) * mc.vocab_size, mc.vocab_size);
      max_dlogprob =
          std::max(max_dlogprob, double(std::abs(lp[size_t(o.token_ids[g])] - o.logprobs[g])));
      std::vector<float> sorted = lp;
      std::sort(sorted.rbegin(), sorted.rend());
      const int ref_best = int(std::max_element(lp.begin(), lp.end()) - lp.begin());
      ++tokens;
      if (ref_best == o.token_ids[g])
        ++token_agree;
      else
        EXPECT_LT(sorted[0] - lp[size_t(o.token_ids[g])], 0.05f)
            << "greedy token differs beyond a near-tie";
    }
    const RouteArray& r = *o.routed_experts;
    // The gate weights the engine combined its experts with are the reference's for the same
    // experts (with the engine's routes replayed), up to bf16 activations.
    ASSERT_EQ(r.weights.size(), r.data.size());
    for (size_t j = 0; j < r.weights.size(); ++j)
      max_dweight = std::max(max_dweight, double(std::abs(r.weights[j] - rep.gate_weights[j])));
    for (int p = 0; p < r.rows; ++p)
      for (int l = 0; l < r.layers; ++l) {
        std::vector<int> a(r.row(p) + l * r.k, r.row(p) + (l + 1) * r.k);
        std::vector<int> b(ref.routes.begin() + (size_t(p) * r.layers + l) * r.k,
                           ref.routes.begin() + (size_t(p) * r.layers + l + 1) * r.k);
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        ++pairs;
        if (a == b) ++agree;  // the statistic: against the reference's own routing
        // Where the engine's set is not what the reference picks at this router, with the
        // engine's routes replayed up to it (so an earlier near-tie that sent the two down
        // different experts does not count against this router), it must be a near-tie there.
        const float* probs = rep.router_probs.data() + (size_t(p) * r.layers + l) * mc.num_experts;
        const RouterChoice own = reference_choice(ck->weights(), l, probs);
        // Sigmoid scores sit near 0.5 where their slope is 1/4, softmax scores near 1/E: the same
        // logit difference (bf16 against fp32 activations) moves a sigmoid score ~2.5x more.
        const float tie = mc.router.scoring == RouterScoring::Sigmoid ? 0.05f : 0.02f;
        if (a != own.experts) {
          EXPECT_LT(own.margin, tie) << "position " << p << " layer " << l;
        } else {
          ++agree_given_history;
        }
      }
  }
  // Gated DeltaNet layers carry the bf16 rounding of their inputs forward in their state, and the
  // gated norm divides by each head's output size: measured on qwen3_next tiny (f32 weights), the
  // gap is 0.010 with every layer full attention, 0.057 with every layer DeltaNet, and 0.021 with
  // every layer DeltaNet when the reference rounds the block's input and output to bf16 as the
  // engine does. So hybrids get a wider bound; the routes' and tokens' checks are the same.
  const double gap = mc.hybrid() ? 0.08 : 0.05;
  EXPECT_LT(max_dlogprob, gap) << "engine (bf16 activations) vs reference (fp32) logprob gap";
  // Gate weights move with the router logits: the same reasoning (and measured spread: at most
  // 0.016 elsewhere, 0.046 on qwen3_5_moe tiny) gives hybrids the wider bound.
  EXPECT_LT(max_dweight, (mc.hybrid() ? 0.08 : 0.03) * mc.router.routed_scaling_factor)
      << "engine vs reference gate weight of the same expert";
  std::printf(
      "[ %s/%s kv %s ] route sets agree on %d/%d (token, layer) pairs (%.4f), %d (%.4f) judging "
      "each router given the engine's history; greedy tokens %d/%d; max |dlogprob| %.4f; max "
      "|dweight| %.4f\n",
      arch.c_str(), preset.c_str(), kv_dtype.c_str(), agree, pairs, double(agree) / pairs,
      agree_given_history, double(agree_given_history) / pairs, token_agree, tokens, max_dlogprob,
      max_dweight);
  EXPECT_GT(double(agree) / pairs, 0.9);
}

INSTANTIATE_TEST_SUITE_P(All, EngineVsReference,
                         ::testing::Combine(::testing::ValuesIn(kAllArchs),
                                            ::testing::Values("tiny", "small"),
                                            ::testing::Values("bf16", "fp32")),
                         [](const auto& i) {
                           return std::get<0>(i.param) + "_" + std::get<1>(i.param) + "_kv_" +
                                  std::get<2>(i.param);
                         });
// Quantized checkpoints as released: block-scaled FP8 (DeepSeek-V3, Qwen3), whose weights the
// engine decodes to bf16 inside the matmul while the reference forward computes with the exact
// fp32 products, and GPT-OSS's MXFP4 experts.
INSTANTIATE_TEST_SUITE_P(
    Quantized, EngineVsReference,
    ::testing::Combine(::testing::Values("deepseek_v3_fp8", "qwen3_moe_fp8", "gpt_oss_mxfp4"),
                       ::testing::Values("tiny", "small"), ::testing::Values("bf16")),
    [](const auto& i) {
      return std::get<0>(i.param) + "_" + std::get<1>(i.param) + "_kv_" + std::get<2>(i.param);
    });

}  // namespace
}  // namespace r3::testing

namespace r3::testing {
namespace {

// Refit from tensors in memory equals refit from the same checkpoint on disk.
TEST(EngineRefit, FromMemoryEqualsFromDisk) {
  const std::string a = test_model("mixtral", "tiny", 0), b = test_model("mixtral", "tiny", 3);
  auto disk = Checkpoint::open(b);
  std::vector<TensorToWrite> tensors;
  std::ifstream cfg(b + "/config.json");
  std::stringstream cfg_text;
  cfg_text << cfg.rdbuf();
  for (TensorToWrite& t : read_safetensors(b + "/model.safetensors"))
    tensors.push_back(std::move(t));
  SamplingParams p;
  p.max_tokens = 6;
  p.temperature = 0.f;
  p.return_routed_experts = true;
  EngineConfig c = solo_config(a);
  Engine e1(c), e2(c);
  e1.update_weights(b, true);
  e2.update_weights(Checkpoint::from_memory(cfg_text.str(), std::move(tensors)), true);
  auto o1 = e1.generate({{3, 4, 5, 6}}, {p})[0], o2 = e2.generate({{3, 4, 5, 6}}, {p})[0];
  expect_matches_solo(o2, o1, false, p, "memory vs disk");
  EXPECT_EQ(o2.weight_versions, std::vector<uint64_t>(6, 1));
  // A tensor of the wrong size is a clear error.
  std::vector<TensorToWrite> bad = {
      {"model.embed_tokens.weight", DType::BF16, {512, 64}, std::vector<uint8_t>(10)}};
  EXPECT_THROW(Checkpoint::from_memory(cfg_text.str(), std::move(bad)), Error);
}

// Two engines on one checkpoint (r3 bench --paired-steps): each gives the solo run's tokens and
// routes; a refit from tensors, which writes the checkpoint in place, is refused while it is
// shared and accepted once the engine holds it alone.
TEST(EngineSharedCheckpoint, SameOutputsAndNoInPlaceRefitWhileShared) {
  const std::string dir = test_model("mixtral", "tiny", 0);
  SamplingParams p;
  p.max_tokens = 6;
  p.temperature = 0.f;
  p.return_routed_experts = true;
  const EngineConfig c = solo_config(dir);
  Engine solo(c);
  const RequestOutput want = solo.generate({{3, 4, 5, 6}}, {p})[0];
  auto ck = Checkpoint::open(dir);
  auto other = std::make_unique<Engine>(c, ck);
  Engine e(c, ck);
  expect_matches_solo(e.generate({{3, 4, 5, 6}}, {p})[0], want, false, p,
                      "first engine on a shared checkpoint");
  expect_matches_solo(other->generate({{3, 4, 5, 6}}, {p})[0], want, false, p,
                      "second engine on a shared checkpoint");
  std::vector<TensorToWrite> bucket;
  for (TensorToWrite& t : ck->stored_tensors())
    if (t.name == "model.embed_tokens.weight") bucket.push_back(std::move(t));
  ASSERT_EQ(bucket.size(), 1u);
  try {
    e.stage_weights(bucket);
    ADD_FAILURE() << "a refit from tensors on a shared checkpoint was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("shared"), std::string::npos) << err.what();
  }
  ck.reset();
  other.reset();
  e.stage_weights(std::move(bucket));
  e.commit_staged_weights(true);
  expect_matches_solo(e.generate({{3, 4, 5, 6}}, {p})[0], want, false, p,
                      "after a refit with the same bytes");
  EXPECT_THROW(Engine(c, std::shared_ptr<Checkpoint>()), Error);
}

// EPLB placement rebuilt from the engine's own load statistics: outputs and routes unchanged,
// replicas go to the most loaded experts.
TEST(EngineRefit, EplbRebalanceFromOwnStatistics) {
  const std::string model = test_model("qwen3_moe");
  Workload w = make_workload(31, 10, 512);
  EngineConfig c = solo_config(model);
  c.max_num_seqs = 8;
  c.eplb_redundant_experts = 2;
  Engine e(c);
  auto before = e.generate(w.prompts, w.params);
  e.rebalance_eplb();
  const uint64_t phys0 =
      e.stats().physical_expert_load[0][8] + e.stats().physical_expert_load[0][9];
  auto after = e.generate(w.prompts, w.params);
  for (size_t i = 0; i < w.prompts.size(); ++i)
    expect_matches_solo(after[i], before[i], false, w.params[i], "request " + std::to_string(i));
  // The replicas of layer 0 ran tokens after the rebalance.
  EXPECT_GT(e.stats().physical_expert_load[0][8] + e.stats().physical_expert_load[0][9], phys0);
}

}  // namespace
}  // namespace r3::testing

namespace r3::testing {
namespace {

// kv_cache_dtype: auto follows the checkpoint's attention weights; bf16 holds twice the blocks of
// fp32 in the same kv_cache_mb; an unknown name is a clear error that names the choices.
TEST(EngineKvCache, DtypeResolutionCapacityAndErrors) {
  const std::string bf16_model = test_model("olmoe"),
                    f32_model = test_model("olmoe", "tiny", 0, DType::F32);
  auto make = [](const std::string& model, const std::string& dtype) {
    EngineConfig c;
    c.model = model;
    c.kv_cache_dtype = dtype;
    c.kv_cache_mb = 8;
    return std::make_unique<Engine>(c);
  };
  EXPECT_EQ(make(bf16_model, "auto")->config().kv_cache_dtype, "bf16");
  EXPECT_EQ(make(f32_model, "auto")->config().kv_cache_dtype, "fp32");
  EXPECT_EQ(make(f32_model, "bfloat16")->config().kv_cache_dtype, "bf16");
  const int bf16_blocks = make(bf16_model, "bf16")->config().num_kv_blocks;
  const int f32_blocks = make(bf16_model, "fp32")->config().num_kv_blocks;
  EXPECT_EQ(bf16_blocks, 2 * f32_blocks);
  try {
    make(bf16_model, "fp8");
    FAIL() << "fp8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("auto, bf16 or fp32"), std::string::npos) << e.what();
  }
  // An fp32 checkpoint may still choose a bf16 cache.
  auto e = make(f32_model, "bf16");
  auto o = e->generate({{1, 2, 3, 4, 5}}, {greedy(8, false)})[0];
  EXPECT_EQ(o.token_ids.size(), 8u);
}

}  // namespace
}  // namespace r3::testing
