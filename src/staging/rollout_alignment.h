// The library half of `r3 align`: runs multi-turn rollouts on the engine with routes, stages
// every call (stage_call), assembles each rollout (assemble_rollout, boundary repair on by
// default), then runs the trainer forward (reference_forward) over each full rollout without
// and with replay of the assembled routes and measures the train/inference mismatch
// (compute_alignment) both ways.
//
// What is scored (the choice r3 makes; the CLI's --help says it too):
// - Logprob metrics (k3_kl, extreme_token_fraction, mean/max |Δ logprob|) use the GENERATED
//   tokens only, the ones an RL loss is computed on. Engine logprob = RequestOutput.logprobs
//   (log-softmax of the engine's raw logits at the sampled token); trainer logprob =
//   log_softmax(reference logits at position p-1)[token p].
// - Router metrics use every position of the rollout (prompt, user and generated tokens) whose
//   assembled row holds a real engine route: filler rows (each call's last token unless the
//   boundary was repaired) and -1 rows (lenient drops) are left out. The trainer side is the
//   reference forward's `routes`, i.e. the experts it actually used. With replay these are the
//   forced sets, so the with-replay disagreement is exactly 0 on the scored rows.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "model/checkpoint.h"
#include "routes/route_array.h"
#include "staging/alignment.h"
#include "staging/staging.h"

namespace r3 {

// One multi-turn rollout: turn 1's prompt, then for each later turn the new user tokens appended
// to everything so far (previous prompts and generated tokens).
struct RolloutSpec {
  std::vector<int> prompt;
  std::vector<std::vector<int>> turns;  // user tokens of turns 2, 3, ...
  int num_turns() const { return 1 + int(turns.size()); }
};

// JSONL line: {"prompt_token_ids":[...], "turns":[[user tokens of turn 2], ...]} ("turns" may be
// absent or empty: a single-turn rollout). Unknown keys, empty prompts or user turns and
// non-integer ids are r3::Error (the caller adds the line number).
RolloutSpec rollout_from_json(const nlohmann::json& j);
// Reads every non-blank line; errors name `name:line`.
std::vector<RolloutSpec> read_rollouts_jsonl(std::istream& in, const std::string& name);

struct RandomRolloutOptions {
  int num_rollouts = 8, turns = 3;
  int min_prompt = 8, max_prompt = 24;  // turn-1 prompt length, uniform
  int min_user = 4, max_user = 12;      // user tokens per later turn, uniform
  uint64_t seed = 0;
};
// Seeded random rollouts over [0, vocab) avoiding the bos and eos ids (pass -1 when none).
// A pure function of its arguments.
std::vector<RolloutSpec> random_rollouts(const RandomRolloutOptions& o, int vocab, int bos_id,
                                         int eos_id);

struct RolloutAlignmentOptions {
  int max_tokens = 16;       // generated per turn
  float temperature = 1.0f;  // engine sampling (0 = greedy)
  float top_p = 1.0f;
  int top_k = 0;
  bool ignore_eos = true;  // every turn generates max_tokens (random models hit eos at random)
  uint64_t seed = 0;       // request seed of (rollout i, turn t) = hash(seed, i, t)
  Filler filler = Filler::MinusOne;
  StagePolicy policy = StagePolicy::Strict;  // strict: a bad call drops its rollout
  bool repair_boundaries = true;
  double extreme_threshold = 2.0;
  int trainer_threads = 0;  // reference forwards run in parallel over rollouts (0 = all cores)
  bool keep_traces = true;  // fill RolloutAlignmentResult::traces
};

// Everything about one rollout (for tests and debugging).
struct RolloutTrace {
  int index = 0;                           // position in the input
  bool dropped = false;                    // strict policy: a call failed to stage
  std::string warning;                     // why dropped, or lenient warnings
  std::vector<int> tokens;                 // the full sequence S
  std::vector<int> call_lens;              // T of each call (prompt + generated so far)
  std::vector<bool> generated;             // [S] sampled by the engine
  std::vector<float> engine_logprobs;      // [S], NaN where not generated
  std::vector<RouteArray> engine_replies;  // raw routed_experts of each call
  RouteArray routes;                       // assembled [S, L, K] (what the trainer replays)
  std::vector<bool> real_route;            // [S] row holds a real engine route (scored for routers)
  AssembleReport report;
  // Trainer side: [S, L, K] experts used and [S] logprobs (NaN where not generated).
  RouteArray trainer_routes_without, trainer_routes_with;
  std::vector<float> trainer_logprobs_without, trainer_logprobs_with;
};

struct RolloutAlignmentResult {
  int tokens = 0;                  // generated tokens scored (logprob metrics)
  int route_rows = 0;              // rows scored for the router metrics
  int repaired_boundary_rows = 0;  // summed AssembleReport counts of kept rollouts
  int filler_rows = 0;
  int rollouts = 0, dropped_rollouts = 0;
  AlignmentMetrics without_replay, with_replay;  // `tokens` = generated tokens scored
  std::vector<double> abs_dlogprob_without, abs_dlogprob_with;  // per generated token
  std::vector<std::string> warnings;
  std::vector<RolloutTrace> traces;  // when keep_traces, one per input rollout
};

// Runs everything on a caller-owned engine (started with enable_return_routed_experts) and
// trainer weights of the same model. Turns run batched across rollouts (turn t of every rollout
// in one engine run). Throws r3::Error for requests the engine refuses, naming the rollout and
// turn. Dropped rollouts (strict policy) are counted and left out of the metrics; when every
// rollout is dropped the metrics are all 0.
RolloutAlignmentResult run_rollout_alignment(Engine& engine, const ModelWeights& trainer,
                                             const std::vector<RolloutSpec>& rollouts,
                                             const RolloutAlignmentOptions& opt);
// Starts its own engine (enable_return_routed_experts forced on) and opens the checkpoint
// cfg.model for the trainer forward.
RolloutAlignmentResult run_rollout_alignment(EngineConfig cfg,
                                             const std::vector<RolloutSpec>& rollouts,
                                             const RolloutAlignmentOptions& opt);

// {"tokens", "repaired_boundary_rows", "filler_rows", "without_replay": {...}, "with_replay":
// {...}} with exactly the keys router_disagreement_pairs, router_disagreement_tokens,
// mean_differing_layers, k3_kl, extreme_token_fraction, mean_abs_dlogprob, max_abs_dlogprob
// in each of the two objects.
nlohmann::json to_json(const RolloutAlignmentResult& r);
nlohmann::json alignment_metrics_json(const AlignmentMetrics& m);  // the 7 keys above

// The readable table: metric | without replay | with replay, then the counts.
std::string format_alignment_table(const RolloutAlignmentResult& r);

}  // namespace r3
