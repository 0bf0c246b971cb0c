// The in-process halves of expert parallelism (the MPI runs are
// tests/python/test_expert_parallel.py): the step message round trip, the placement of physical
// experts on ranks, a rank's checkpoint view without the other ranks' experts, and the engine's
// refusals.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "engine/engine.h"
#include "engine/engine_config_json.h"
#include "engine/expert_exchange.h"
#include "kernels/matmul.h"
#include "model/checkpoint.h"
#include "step/step_wire.h"
#include "test_models.h"

namespace r3 {
namespace {

TEST(StepWire, RoundTripsEveryFieldAndRefusesTruncation) {
  StepPlan plan;
  plan.iter = 41;
  plan.weight_version = 3;
  plan.num_padding = 2;
  plan.any_routes = true;
  for (int s = 0; s < 3; ++s) {
    PlannedSeq q;
    q.request_id = 100 + uint64_t(s);
    q.first_token = s * 4;
    q.num_tokens = 4;
    q.start_pos = 7 * s;
    q.table_offset = s * 2;
    q.table_len = 2;
    q.sample = s != 1;
    q.sampler.temperature = 0.5f + float(s);
    q.sampler.seed = 9 + uint64_t(s);
    q.wants_routes = true;
    plan.seqs.push_back(q);
  }
  std::vector<int> ids;
  for (int t = 0; t < 14; ++t) {
    PlannedToken k;
    k.seq = t < 12 ? t / 4 : -1;
    k.position = t;
    k.token = 1000 + t;
    k.block = t / 3;
    k.block_generation = 77 + uint64_t(t);
    k.slot = t % 3;
    plan.tokens.push_back(k);
    ids.push_back(5 * t);
  }
  plan.block_tables = {1, 2, 3, 4, 5, 6};
  plan.window_tables = {-1, 2};
  plan.hit_generations = {8, 9};
  plan.scores = {{0, 1, 42, 2}};
  std::vector<uint8_t> bytes;
  write_step(plan, ids.data(), bytes);
  StepPlan back;
  std::vector<int> back_ids;
  read_step(bytes, back, back_ids);
  EXPECT_EQ(back.iter, 41u);
  EXPECT_EQ(back.weight_version, 3u);
  EXPECT_EQ(back.num_padding, 2);
  EXPECT_TRUE(back.any_routes);
  ASSERT_EQ(back.seqs.size(), 3u);
  EXPECT_EQ(std::memcmp(back.seqs.data(), plan.seqs.data(), 3 * sizeof(PlannedSeq)), 0);
  ASSERT_EQ(back.tokens.size(), 14u);
  EXPECT_EQ(std::memcmp(back.tokens.data(), plan.tokens.data(), 14 * sizeof(PlannedToken)), 0);
  EXPECT_EQ(back.block_tables, plan.block_tables);
  EXPECT_EQ(back.window_tables, plan.window_tables);
  EXPECT_EQ(back.hit_generations, plan.hit_generations);
  ASSERT_EQ(back.scores.size(), 1u);
  EXPECT_EQ(back.scores[0].target, 42);
  EXPECT_EQ(back_ids, ids);
  for (size_t cut : {size_t(0), size_t(10), bytes.size() - 1}) {
    std::vector<uint8_t> part(bytes.begin(), bytes.begin() + long(cut));
    EXPECT_THROW(read_step(part, back, back_ids), Error) << cut;
  }
  bytes.push_back(0);
  EXPECT_THROW(read_step(bytes, back, back_ids), Error);
}

TEST(ExpertPlacement, RanksTileThePhysicalExpertsAndHoldEveryReplica) {
  for (int P : {8, 11, 64, 67})
    for (int N : {1, 2, 3, 4}) {
      EXPECT_EQ(first_physical(0, N, P), 0);
      EXPECT_EQ(first_physical(N, N, P), P);
      for (int p = 0; p < P; ++p) {
        const int owner = p * N / P;  // docs/EXPERT_PARALLEL.md
        EXPECT_LE(first_physical(owner, N, P), p);
        EXPECT_LT(p, first_physical(owner + 1, N, P));
      }
    }
  // EPLB replicas: a rank holds the logical expert of every physical one in its range, so a
  // replicated expert is held by both ranks when its replica lands on the other one.
  const EplbMap map(2, 8, 4, {{9, 1, 1, 1, 1, 1, 1, 8}, {0, 0, 0, 5, 0, 0, 0, 0}});
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<int> holders(8, 0);
    for (int r = 0; r < 2; ++r) {
      const auto held = held_experts(map, 2, 8, r, 2);
      for (int p = first_physical(r, 2, 12); p < first_physical(r + 1, 2, 12); ++p)
        EXPECT_TRUE(held[size_t(layer)][size_t(map.logical_of(layer, p))]);
      for (int e = 0; e < 8; ++e) holders[size_t(e)] += held[size_t(layer)][size_t(e)];
    }
    for (int e = 0; e < 8; ++e) EXPECT_GE(holders[size_t(e)], 1) << e;
  }
  EXPECT_TRUE(held_experts(map, 2, 8, 0, 2)[0][0]);  // logical 0 (physical 0) on rank 0 ...
  EXPECT_TRUE(held_experts(map, 2, 8, 1, 2)[0][0]);  // ... and its replica (physical 8) on rank 1
}

// Whether a's packed panels (its only copy, scales included) equal b's.
bool same_bytes(const TensorView& a, const TensorView& b) {
  if (a.dtype != b.dtype || a.shape != b.shape || !a.packed || !b.packed) return false;
  if (std::memcmp(a.packed, b.packed, kernels::packed_bf16_size(a) * 2) != 0) return false;
  if (a.scale_inv && std::memcmp(a.scale_inv, b.scale_inv, size_t(a.num_block_scales()) * 4) != 0)
    return false;
  return true;
}

// Each rank of two (EPLB replicas included) reads exactly the experts it holds, with the bytes a
// full load reads, in every layout: one tensor per expert (bf16, FP8 with scales) and one fused
// tensor per layer (GPT-OSS, bf16 and MXFP4), whose other rows are never read.
TEST(ExpertParallelCheckpoint, EachRankReadsExactlyItsOwnExperts) {
  for (const std::string arch : {"olmoe", "deepseek_v3_fp8", "gpt_oss", "gpt_oss_mxfp4"}) {
    auto full = Checkpoint::open(testing::test_model(arch));
    const ModelConfig& c = full->config();
    const EplbMap map(c.num_moe_layers(), c.num_experts, 2, {});
    const std::vector<int> layers = c.moe_layers();
    for (int rank = 0; rank < 2; ++rank) {
      const auto held = held_experts(map, c.num_moe_layers(), c.num_experts, rank, 2);
      auto part =
          Checkpoint::open(testing::test_model(arch), [&](const ModelConfig&) { return held; });
      size_t missing = 0;
      for (size_t m = 0; m < layers.size(); ++m)
        for (int e = 0; e < c.num_experts; ++e) {
          SCOPED_TRACE(arch + " rank " + std::to_string(rank) + " layer " +
                       std::to_string(layers[m]) + " expert " + std::to_string(e));
          const ExpertWeights& w = part->weights().layers[size_t(layers[m])].experts[size_t(e)];
          const ExpertWeights& f = full->weights().layers[size_t(layers[m])].experts[size_t(e)];
          if (!held[m][size_t(e)]) {
            EXPECT_TRUE(w.gate.empty());
            EXPECT_TRUE(w.down.empty());
            ++missing;
            continue;
          }
          EXPECT_TRUE(same_bytes(w.gate, f.gate));
          EXPECT_TRUE(same_bytes(w.up, f.up));
          EXPECT_TRUE(same_bytes(w.down, f.down));
        }
      EXPECT_GT(missing, 0u) << arch;  // each rank leaves some on disk ...
      EXPECT_LT(missing, layers.size() * size_t(c.num_experts)) << arch;  // ... and holds some
      EXPECT_THROW(part->stored_tensors(), Error)
          << arch;  // a partial view is not the trainer's weights
    }
  }
}

TEST(ExpertParallelEngine, RefusedWithoutMpiAndItsConfigRoundTrips) {
  EngineConfig c;
  c.model = testing::test_model("olmoe");
  c.num_kv_blocks = 64;
  c.expert_parallel = 2;
  c.expert_timeout_s = 4.5;
  c.decode_buckets = {1, 4};
  c.eplb_redundant_experts = 2;
  c.eplb_load = {{1, 2}, {3}};
  try {
    Engine e(c);
    FAIL() << "an expert-parallel engine started without MPI";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mpirun -np 2 r3"), std::string::npos) << e.what();
  }
  const EngineConfig back = engine_config_from_json(engine_config_to_json(c));
  EXPECT_EQ(engine_config_to_json(back), engine_config_to_json(c));
  EXPECT_EQ(back.expert_timeout_s, 4.5);
  EXPECT_EQ(back.eplb_load, c.eplb_load);
  EXPECT_THROW(engine_config_from_json("{\"model\": 1}"), Error);
  c.expert_parallel = 0;
  EXPECT_THROW(Engine{c}, Error);
}

}  // namespace
}  // namespace r3
