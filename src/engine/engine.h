// The engine: requests in, outputs out. Owns the KV pool, scheduler, model runner and route
// manager; step() runs one iteration. With overlap scheduling the forward runs on a worker
// thread and the next step is planned (and the previous one committed) while it computes.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "core/thread_pool.h"
#include "engine/expert_exchange.h"
#include "engine/kv_pool.h"
#include "engine/model_runner.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/step_sampler.h"
#include "routes/route_array.h"
#include "routes/route_capturer.h"
#include "routes/route_manager.h"
#include "text/tokenizer.h"

namespace r3 {

struct EngineConfig {
  std::string model;  // checkpoint directory
  // Directory with tokenizer.json (+ tokenizer_config.json): "" = the checkpoint's own, when it
  // has one. With a tokenizer, outputs carry text and requests may use stop strings.
  std::string tokenizer;
  int block_size = 16;
  int num_kv_blocks = 0;  // 0 = as many as fit in kv_cache_mb
  int kv_cache_mb = 1024;
  // KV cache element: "auto" (bf16 when the checkpoint's attention weights are bf16, else fp32),
  // "bf16" (half the memory of fp32: twice the tokens in kv_cache_mb) or "fp32".
  std::string kv_cache_dtype = "auto";
  int max_num_seqs = 32;
  int max_num_batched_tokens = 512;
  bool enable_prefix_caching = true;
  // Hybrid models (Gated DeltaNet): recurrent-state snapshots kept for prefix caching
  // (engine/state_snapshots.h), each Engine::recurrent_state_bytes_per_request() bytes,
  // committed as written. -1 = 2 x max_num_seqs; 0 = none (hybrids then get no prefix hits).
  int max_state_snapshots = -1;
  bool overlap_scheduler = false;
  std::vector<int> decode_buckets;
  int threads = 0;  // 0 = hardware concurrency
  bool enable_return_routed_experts = false;
  int eplb_redundant_experts = 0;
  std::vector<std::vector<uint64_t>> eplb_load;  // optional placement input [L_moe][E]
  // Expert parallelism (docs/EXPERT_PARALLEL.md): this many ranks share the experts, each
  // computing every step; the r3 command under `mpirun -np N`. 1 = one process.
  int expert_parallel = 1;
  // A rank that does not answer within this many seconds fails the engine (every request in
  // flight ends with an error) instead of hanging it.
  double expert_timeout_s = 30;
  // Speculative decoding (docs/ARCHITECTURE.md), SGLang's names: "" (off) or "NGRAM" (drafts
  // from the request's own prompt and output); "NEXTN" (the checkpoint's MTP layers) is refused,
  // not built yet. Outputs, logprobs and routes are bit-identical to decoding without it.
  std::string speculative_algorithm;
  int speculative_num_draft_tokens = 4;  // drafted tokens verified with each decoding token
  int speculative_ngram_min_match_window_size = 1;
  int speculative_ngram_max_match_window_size = 12;
  // Steps with more requests decoding than this draft nothing (vLLM's disable_by_batch_size).
  int speculative_disable_by_batch_size = 8;
};

struct RequestOutput {
  uint64_t request_id = 0;
  std::vector<int> prompt_token_ids, token_ids;
  std::vector<float> logprobs;
  std::vector<uint64_t> weight_versions;  // per generated token
  // The detokenised output (an engine with a tokenizer). While the request runs, the bytes a
  // stop string could still begin with are held back, so the text only ever grows.
  std::string text;
  std::string stop_str;  // the stop string that finished the request (finish_reason "stop")
  // Scoring: the top alternatives of each generated token (top_logprobs > 0), and from
  // prompt_logprobs_start on each prompt token's logprob given the tokens before it (position
  // 0 has none: NaN) with its top alternatives.
  std::vector<TopLogprobs> top_logprobs;
  int prompt_logprobs_start = -1;
  std::vector<float> prompt_logprobs;
  std::vector<TopLogprobs> prompt_top_logprobs;
  bool finished = false;
  std::string finish_reason;
  // [S-1 - start, L_moe, K]; while a stream_routes request runs, only the rows new since its
  // previous output (their first row is .start).
  std::optional<RouteArray> routed_experts;
  std::string routes_error;  // set when routes could not be complete
  // Set when the request failed (finish_reason "error"): no token was sampled from bad values
  // and no routes are returned.
  std::string error;
  int num_cached_tokens = 0;
  int num_preemptions = 0;
};

struct EngineStats {
  uint64_t steps = 0, prompt_tokens = 0, generated_tokens = 0, computed_tokens = 0;
  uint64_t preemptions = 0, prefix_hit_tokens = 0, prefix_queried_tokens = 0, chunked_prefills = 0,
           padded_tokens = 0;
  uint64_t capture_waits = 0, routed_experts_gaps = 0, route_rows_committed = 0,
           prefix_route_rows_copied = 0, stale_prefix_rows = 0, route_bytes_returned = 0;
  uint64_t requests_finished = 0, requests_aborted = 0, weight_version = 0;
  // Speculative decoding: drafted tokens verified, how many of them were accepted, and steps
  // that drafted nothing because more than speculative_disable_by_batch_size requests decoded.
  uint64_t spec_draft_tokens = 0, spec_accepted_tokens = 0, spec_steps_off = 0;
  // Hybrids: the recurrent states kept after each draft so a rejected one can be undone
  // (min(speculative_disable_by_batch_size, max_num_seqs) x K x recurrent_state_bytes_per_request).
  uint64_t spec_draft_state_bytes = 0;
  uint64_t weight_bytes_read = 0;  // by this process (expert parallelism: rank 0's experts only)
  // Wall time the step thread spent committing captured routes and assembling finished
  // requests' routes (the bookkeeping routes add beyond capture in the forward).
  double route_seconds = 0;
  // Wall time of attention over the KV cache (both cores: the loops that read the cache), so a
  // benchmark can set the KV bytes read against attention's own time.
  double attention_seconds = 0;
  double deltanet_seconds = 0;  // in Gated DeltaNet blocks (hybrids), their projections included
  int running = 0, waiting = 0, free_blocks = 0, num_blocks = 0;
  int free_window_blocks = 0, num_window_blocks = 0;  // the sliding-window layers' pool (0: none)
  uint64_t window_blocks_freed = 0;                   // of it, released as windows slid past
  int block_size = 0;
  std::string kv_cache_dtype;     // as resolved: "bf16" or "fp32"
  uint64_t published_blocks = 0;  // full blocks entered in the prefix cache
  // Hybrids: recurrent-state snapshots (engine/state_snapshots.h): slots, findable ones, taken,
  // prefix hits restored from one, hit tokens given up where no snapshot ended, bytes reserved.
  int state_snapshots = 0, state_snapshots_held = 0;
  uint64_t state_snapshots_taken = 0, state_snapshot_restores = 0, state_snapshot_cut_tokens = 0;
  uint64_t state_snapshot_bytes = 0;
  uint64_t recurrent_state_bytes_per_request = 0;  // hybrids: a running request's DeltaNet state
  std::vector<std::vector<uint64_t>> expert_load;  // [L_moe][E] tokens per logical expert
  std::vector<std::vector<uint64_t>> physical_expert_load;  // [L_moe][E + redundant] (EPLB)
  std::vector<int> moe_layers;
};

// The KV cache element for EngineConfig::kv_cache_dtype (throws on an unknown name).
DType resolve_kv_cache_dtype(const std::string& name, const ModelWeights& weights);

// What start-up cost, measured as it happened: one line for `r3 serve` and `r3 generate`, and the
// figures `r3 bench` reports.
struct StartupReport {
  double open_seconds = 0;   // open the checkpoint: read, check and pack it (0 when it was shared)
  double read_seconds = 0;   // of open: waiting for the files' bytes
  double pack_seconds = 0;   // of open: packing them into panels (their pages' first touch too)
  double build_seconds = 0;  // the runner, the KV pool and the threads
  double total_seconds = 0;  // the whole constructor
  uint64_t checkpoint_bytes = 0;  // the stored tensors
  uint64_t kv_bytes = 0;          // the KV pools (committed as written)
  double resident_mb = 0;         // the process at the end of start-up
  std::string line() const;
};

class Engine {
 public:
  explicit Engine(EngineConfig cfg);
  // One of ranks 1..N-1 of an expert-parallel engine (src/parallel/): it computes the steps rank
  // 0 plans, handed to compute_step.
  Engine(EngineConfig cfg, std::unique_ptr<ExpertExchange> exchange);
  // An engine on a checkpoint another engine already holds (cfg.model names its directory): one
  // copy of the stored weights, panels packed per engine (r3 bench --paired-steps runs two
  // engines side by side). A refit from tensors writes the checkpoint's storage in place, so it
  // is refused while the checkpoint is shared; update_weights gives the engine its own.
  Engine(EngineConfig cfg, std::shared_ptr<Checkpoint> shared);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelConfig& model_config() const { return runner_->config(); }
  const EngineConfig& config() const { return cfg_; }
  // Gated DeltaNet models: the recurrent and conv state one running request holds (fp32, all its
  // DeltaNet layers); max_num_seqs of them are allocated. 0 for other models.
  uint64_t recurrent_state_bytes_per_request() const;
  const Checkpoint& checkpoint() const { return *ckpt_; }
  const StartupReport& startup() const { return startup_; }
  // The tokenizer (EngineConfig::tokenizer), or null when the engine has none.
  std::shared_ptr<const text::Tokenizer> tokenizer() const { return tokenizer_; }

  // Validates and queues a request; throws r3::Error (bad ids, too long, routes not enabled...).
  // `group`: the submission the request belongs to (below 2^63; the requests of one group wait
  // in order and groups take turns, WaitingQueue); by default a group of its own (plain FIFO).
  static constexpr uint64_t kOwnGroup = ~uint64_t(0);
  uint64_t add_request(std::vector<int> prompt, SamplingParams params, uint64_t group = kOwnGroup);
  // One iteration: outputs of the requests that changed (finished ones with finished = true).
  std::vector<RequestOutput> step();
  // Finishes a request with reason "abort" (its output comes from the next step(), or from
  // apply_aborts()).
  bool abort(uint64_t id);
  // Finishes the aborted requests now, without running the model (a paused engine still
  // answers aborts); returns their outputs and any drained by waiting for a step in flight.
  std::vector<RequestOutput> apply_aborts();
  bool has_unfinished() const;
  // Runs until every given request finished; outputs in input order.
  std::vector<RequestOutput> generate(const std::vector<std::vector<int>>& prompts,
                                      const std::vector<SamplingParams>& params);
  // RL refit: new weights for the same model description (every config key and tensor dtype
  // equal, else r3::Error naming the differences and the old weights keep serving); the version
  // counter increases. With flush, the prefix cache and its routes are dropped in the same step.
  // From a directory the refit is in place, a layer at a time (Checkpoint::refit_from): whatever
  // needs no weight value (description, headers, shapes, dtypes, block scales) is checked first;
  // a failure after the weights began to change (a NaN in a layer, a file truncated meanwhile)
  // ends the unfinished requests (reason abort) and refuses new ones with an error naming that
  // refit until a refit of every weight succeeds (failed_refit()).
  void update_weights(const std::string& checkpoint_dir, bool flush_prefix_cache);
  // The same from a checkpoint's headers (Checkpoint::headers, read where the time does not
  // stall the engine, e.g. the server's HTTP thread).
  void update_weights_from_headers(const std::shared_ptr<Checkpoint>& headers,
                                   bool flush_prefix_cache);
  void update_weights(std::shared_ptr<Checkpoint> ckpt, bool flush_prefix_cache);
  uint64_t weight_version() const { return weight_version_; }
  // Why requests are refused after a refit failed midway; empty when the weights are one set.
  const std::string& failed_refit() const { return failed_refit_; }
  // In-memory refit in buckets (a trainer sending its weights by Hugging Face name). Each bucket
  // is checked against the served model first (name, shape, dtype, values; a refused bucket
  // changes nothing). Its tensors are then packed into the panels they replace, in place, as soon
  // as the tensors packed with them (sent_together) have arrived: the refit holds about a bucket
  // beyond the resident weights, never a second copy. From the first tensor applied until the
  // last bucket (commit), running requests end with reason abort and new ones are refused naming
  // the refit: no step ever runs on a mix of two weight sets. Commit applies what is left, the
  // version goes up (flush: the prefix cache is dropped); a last bucket refused after earlier ones
  // changed the weights leaves the engine refusing requests until a refit succeeds. With the
  // weights released (release_memory) the buckets are kept until commit, which needs them all.
  void stage_weights(std::vector<TensorToWrite> tensors);
  void commit_staged_weights(bool flush_prefix_cache);
  // Tensors sent in the buckets of the refit under way.
  size_t staged_weight_tensors() const { return refit_sent_.size(); }
  // EPLB: rebuilds the logical -> physical placement from the engine's own expert-load
  // statistics (the most loaded experts get the replicas). Between steps; routes and outputs
  // do not change.
  void rebalance_eplb();
  // Drops the prefix cache (and its routes). Refused (false) while any request is unfinished,
  // as SGLang's flush_cache is: their KV would still be in use.
  bool reset_prefix_cache();
  // Preempts every running request: their KV is freed and recomputed when they run again
  // (outputs and routes stay bit-identical by batch invariance). Returns how many.
  int retract_all();
  // Gives the KV cache and/or the packed weights back to the operating system (the engine must
  // be idle: r3::Error otherwise) and rebuilds them; no step may run in between (step() throws).
  void release_memory(bool kv_cache, bool weights);
  void resume_memory(bool kv_cache, bool weights);
  bool memory_released() const { return runner_->memory_released(); }

  // Speculative decoding: drafts from `d` instead of the n-gram drafter (a model-based drafter,
  // or a test's). The engine must have speculation on and no request yet; a draft is cut at its
  // first token outside the vocabulary. Outputs stay those without speculation whatever it drafts.
  void set_drafter(Drafter d);
  EngineStats stats() const;
  // Resident memory in MB of every rank of the engine (one entry without expert parallelism).
  std::vector<double> resident_mb_by_rank() const;
  int expert_parallel_ranks() const { return exchange_ ? exchange_->ranks() : 1; }
  // Ranks 1..N-1 of an expert-parallel engine: computes a step rank 0 planned (no sampling, no
  // route capture: rank 0 does both).
  void compute_step(const StepPlan& plan, const int* token_ids) {
    runner_->forward(plan, token_ids, nullptr);
  }
  // Refit, memory release and rebalancing would have to reach every rank: refused (r3::Error)
  // under expert parallelism. Callers check before reading a new checkpoint.
  void refuse_under_expert_parallel(const char* what) const;

 private:
  Engine(EngineConfig cfg, std::unique_ptr<ExpertExchange> exchange,
         std::shared_ptr<Checkpoint> shared);
  // Speculative decoding's settings and what it cannot be combined with: r3::Error naming it.
  void refuse_speculation_conflicts(const ModelConfig& mc) const;
  // A refit that writes the checkpoint in place: refused (r3::Error) while another owner holds it.
  void refuse_on_shared_checkpoint(const char* what) const;
  // A refit's checkpoint describes the served model (config keys, tensor dtypes), else r3::Error.
  void refuse_model_change(const Checkpoint& next) const;
  // A forward job of the overlap worker. Plans, results and jobs come in two buffers (the step
  // in flight and the one being planned) that are reused, so a step allocates nothing.
  struct Job {
    bool done = false;
    CaptureSlot* slot = nullptr;
    std::exception_ptr error;
  };
  CaptureSlot* run_forward(int buffer);
  void submit(int buffer);
  CaptureSlot* wait_for(int buffer);
  void process(int buffer, CaptureSlot* slot, std::vector<RequestOutput>& out);
  void drain();
  void finish(Request* r, const std::string& reason, std::vector<RequestOutput>& out);
  // Appends the new token's text; true when a stop string matched (the text is cut there).
  bool extend_text(Request* r, int token);
  void finish_aborted(std::vector<RequestOutput>& out);  // every request abort() named
  void drop_prefix_cache();  // published blocks and their shared-cache routes
  RequestOutput make_output(const Request& r);
  void publish_full_blocks(Request* r, int computed);
  void worker_loop();
  // Packs sent tensors into the checkpoint's panels and rebuilds the runner's views (between
  // steps).
  void apply_sent(std::vector<TensorToWrite> tensors);
  void abort_unfinished();     // every unfinished request ends with reason abort
  void forget_bucket_refit();  // a refit from a checkpoint supersedes the buckets under way
  // Throws while the served weights are not one set (a failed refit, buckets under way).
  void refuse_mixed_weights() const;

  EngineConfig cfg_;
  std::shared_ptr<Checkpoint> ckpt_;
  StartupReport startup_;
  std::shared_ptr<const text::Tokenizer> tokenizer_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<KvPool> kv_;
  std::unique_ptr<KvPool>
      window_kv_;  // the sliding-window layers' blocks (null without such layers)
  std::unique_ptr<StateSnapshots> snapshots_;  // hybrids' recurrent-state snapshots (null: none)
  std::unique_ptr<ExpertExchange> exchange_;   // expert parallelism, or null
  std::unique_ptr<ModelRunner> runner_;
  StepSampler sampler_;         // placeholders, sampling, scoring: on the thread that runs forwards
  std::vector<int> token_ids_;  // the step's token ids, placeholders resolved
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<RouteCapturer> capturer_;
  std::unique_ptr<RouteManager> routes_;
  std::map<uint64_t, std::unique_ptr<Request>> requests_;
  std::vector<uint64_t> aborted_;  // in the order asked, once each (aborted_set_)
  std::unordered_set<uint64_t> aborted_set_;
  std::map<std::string, TensorToWrite> staged_;  // sent, waiting for the tensors packed with them
  std::set<std::string> refit_sent_;  // every tensor the buckets of the refit under way sent
  bool refit_in_place_ = false;  // some of them are applied: the weights are part old, part new
  // The storage the last commit's tensors replaced, freed on a side thread: handing gigabytes of
  // pages back costs about what copying them would, and generation need not wait for it.
  std::future<void> freeing_replaced_;
  StepPlan plans_[2];
  StepResult results_[2];
  Job jobs_[2];
  int in_flight_ = -1;                  // buffer of the step computing on the worker, or -1
  std::vector<RequestOutput> drained_;  // outputs of a step drained outside step()
  std::vector<int> block_tokens_;
  uint64_t next_id_ = 0, next_iter_ = 0, weight_version_ = 0, arrival_ = 0;
  std::string failed_refit_;  // set when a refit failed after the weights began to change
  uint64_t route_ns_ = 0;     // EngineStats::route_seconds
  uint64_t draft_tokens_ = 0, accepted_draft_tokens_ = 0;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0, computed_tokens_ = 0, finished_ = 0,
           aborted_count_ = 0;
  // Forward worker (overlap scheduling).
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  int queue_[2] = {0, 0};
  int queue_head_ = 0, queue_size_ = 0;
  bool stop_ = false;
};

}  // namespace r3
