// What an engine needs from the other processes of an expert-parallel group
// (docs/EXPERT_PARALLEL.md): every rank holds the non-expert weights and a KV cache and computes
// every step; the physical experts are shared out in contiguous ranges. Rank 0 plans, samples
// and commits routes, and hands each step to the others before computing it; in every MoE layer
// each rank computes the rows of its own experts and gather_expert_rows gives every rank all of
// them, so each token sums its k outputs in router order exactly as one process does.
// The engine sees only this interface; src/parallel/ implements it over MPI.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "routes/eplb.h"
#include "step/step_plan.h"

namespace r3 {

// The physical experts of rank r are [first_physical(r), first_physical(r + 1)): physical p sits
// on rank p * ranks / num_physical.
inline int first_physical(int rank, int ranks, int num_physical) {
  return int((int64_t(rank) * num_physical + ranks - 1) / ranks);
}

// Whether rank `rank` of `ranks` holds each logical expert (one of its physical replicas) of each
// MoE layer: [L_moe][E]. Without EPLB the physical experts are the logical ones.
std::vector<std::vector<bool>> held_experts(const EplbMap& map, int num_moe_layers, int num_experts,
                                            int rank, int ranks);

class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // Every rank, once its engine is built: waits until all ranks built theirs (ok) or one failed
  // (r3::Error naming it). Rank 0's exchange told the others to build theirs when it was opened.
  virtual void started(bool ok) = 0;
  // Rank 0, before computing a step: the plan and its token ids (placeholders resolved) to every
  // other rank.
  virtual void send_step(const StepPlan& plan, const int* token_ids) = 0;
  // Every rank: rows [row_at(first_physical(r)), row_at(first_physical(r + 1))) of `rows`
  // ([num_rows, width], the slots of one MoE layer grouped by physical expert) were computed by
  // rank r; afterwards every rank holds all of them. row_at(p) = offsets[p].
  virtual void gather_expert_rows(float* rows, const int* offsets, int num_physical, int width) = 0;
  // Rank 0: every rank's resident memory in MB, by rank.
  virtual std::vector<double> resident_mb_by_rank() = 0;
};

// Opens rank 0's side of a new expert-parallel engine (the other ranks build theirs from
// `config_json`). Set by a front end that runs under MPI (tools/main.cc); null elsewhere.
using ExpertExchangeOpener = std::function<std::unique_ptr<ExpertExchange>(
    int ranks, double timeout_s, const std::string& config_json)>;
void set_expert_exchange_opener(ExpertExchangeOpener opener);
const ExpertExchangeOpener& expert_exchange_opener();

}  // namespace r3
