// Train/inference alignment metrics (FACTS.md "Alignment metrics"): router disagreement between
// the engine's routes and the trainer's own routing, and the logprob mismatch of the sampled
// tokens (k3 KL, extreme-token fraction, |Δ logprob|). Plus a dependency-free SVG histogram of
// |Δ logprob| with and without routing replay.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "routes/route_array.h"

namespace r3 {

struct AlignmentMetrics {
  int tokens = 0;  // tokens scored (all T, for the logprob metrics)
  double router_disagreement_pairs =
      0;  // fraction of (token, MoE layer) pairs whose expert SETS differ
  double router_disagreement_tokens = 0;  // fraction of tokens with >= 1 differing layer
  double mean_differing_layers = 0;       // mean differing layers per token
  double k3_kl = 0;  // mean of r - 1 - log r, r = pi_train / pi_infer of the sampled token
  double extreme_token_fraction = 0;  // fraction with max(r, 1/r) > threshold (default 2)
  double mean_abs_dlogprob = 0, max_abs_dlogprob = 0;
  // Not in to_json (its keys are fixed): how the router metrics were counted.
  int router_tokens = 0;       // rows scored for the router metrics (denominator)
  int skipped_route_rows = 0;  // rows with any -1 in either array, left out of them
};

// engine/trainer routes [T, L, K] (rows with any -1 in either are skipped for the router metrics
// and counted in skipped_route_rows), logprobs [T] of the sampled tokens (log pi; engine =
// pi_infer, trainer = pi_train); the logprob metrics use all T. The router fractions are over the
// scored rows (0 when none). Throws r3::Error when shapes disagree (routes vs each other, rows vs
// T, the two logprob vectors) or a logprob is not finite.
AlignmentMetrics compute_alignment(const RouteArray& engine, const RouteArray& trainer,
                                   const std::vector<float>& engine_logprobs,
                                   const std::vector<float>& trainer_logprobs,
                                   double extreme_threshold = 2.0);

// Keys exactly: tokens, router_disagreement_pairs, router_disagreement_tokens,
// mean_differing_layers, k3_kl, extreme_token_fraction, mean_abs_dlogprob, max_abs_dlogprob.
nlohmann::json to_json(const AlignmentMetrics& m);

// |trainer - engine| per token (sizes must match; throws r3::Error otherwise).
std::vector<double> abs_dlogprobs(const std::vector<float>& engine_logprobs,
                                  const std::vector<float>& trainer_logprobs);

// A standalone SVG of the |Δ logprob| distributions without and with replay: two overlaid
// histograms (each normalised to its own token count), log-scaled x bins (4 per decade, spanning
// the decades the data covers, at most 12) plus a leftmost bin for values below the lowest
// decade (exact zeros included), legend with counts and means, axis labels. Non-finite values
// are ignored and negative values taken as absolute. Plain SVG text, no dependencies.
std::string dlogprob_histogram_svg(const std::vector<double>& without_replay,
                                   const std::vector<double>& with_replay);

}  // namespace r3
