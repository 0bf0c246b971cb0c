#include "engine/engine.h"
#include "engine/engine_config_json.h"

#include "text/utf8.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "core/resident_memory.h"
#include "core/scoped_nanoseconds.h"
#include "core/seconds_since.h"
#include "engine/capturable.h"
#include "kernels/attention_choice.h"
#include "kernels/kernel_set.h"
#include "kernels/tile_choice.h"

namespace r3 {

DType resolve_kv_cache_dtype(const std::string& name, const ModelWeights& w) {
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "fp32" || name == "float32") return DType::F32;
  // auto: bf16 when the weights are computed as bf16 (bf16, MXFP4 or FP8), fp32 for fp32 weights.
  if (name == "auto")
    return w.layers.empty() || w.layers[0].q.dtype == DType::F32 ? DType::F32 : DType::BF16;
  throw Error("kv_cache_dtype must be auto, bf16 or fp32, got \"" + name + "\"");
}

namespace {

// The engine's starting placement of physical experts (none without EPLB).
EplbMap eplb_for(const EngineConfig& cfg, const ModelConfig& mc) {
  if (cfg.eplb_redundant_experts <= 0) return {};
  return EplbMap(mc.num_moe_layers(), mc.num_experts, cfg.eplb_redundant_experts, cfg.eplb_load);
}
}  // namespace

Engine::Engine(EngineConfig cfg) : Engine(std::move(cfg), nullptr, nullptr) {}

Engine::Engine(EngineConfig cfg, std::unique_ptr<ExpertExchange> exchange)
    : Engine(std::move(cfg), std::move(exchange), nullptr) {}

Engine::Engine(EngineConfig cfg, std::shared_ptr<Checkpoint> shared)
    : Engine(std::move(cfg), nullptr,
             shared ? std::move(shared) : throw Error("Engine: the shared checkpoint is null")) {}

Engine::Engine(EngineConfig cfg, std::unique_ptr<ExpertExchange> exchange,
               std::shared_ptr<Checkpoint> shared)
    : cfg_(std::move(cfg)), ckpt_(std::move(shared)), exchange_(std::move(exchange)) {
  if (ckpt_ && cfg_.expert_parallel > 1)
    throw Error(
        "expert_parallel: every rank reads its own experts from the checkpoint directory; a shared "
        "checkpoint "
        "cannot serve them");
  if (cfg_.block_size <= 0) throw Error("block_size must be positive");
  if (cfg_.expert_parallel < 1) throw Error("expert_parallel must be at least 1");
  if (!(cfg_.expert_timeout_s > 0)) throw Error("expert_timeout_s must be positive");
  if (cfg_.expert_parallel > 1 && !exchange_) {
    if (!expert_exchange_opener())
      throw Error("expert_parallel " + std::to_string(cfg_.expert_parallel) +
                  " needs the r3 command started by MPI: mpirun -np " +
                  std::to_string(cfg_.expert_parallel) + " r3 <verb> ... --expert-parallel " +
                  std::to_string(cfg_.expert_parallel));
    // The other ranks start building theirs now, alongside this one.
    exchange_ = expert_exchange_opener()(cfg_.expert_parallel, cfg_.expert_timeout_s,
                                         engine_config_to_json(cfg_));
  }
  if (cfg_.max_num_seqs <= 0) throw Error("max_num_seqs must be positive");
  if (cfg_.max_num_batched_tokens <= 0) throw Error("max_num_batched_tokens must be positive");
  for (int b : cfg_.decode_buckets)
    if (b <= 0) throw Error("decode_buckets must be positive");
  kernels::active_kernels();    // a bad R3_KERNELS fails here, before any weight is read
  kernels::tuned_bf16_tiles();  // likewise a bad R3_TILES; timed once per CPU model, then cached
  kernels::tuned_decode_attention();  // and R3_ATTENTION; the same
  // An expert-parallel rank reads only its own experts (the others' stay on disk).
  Checkpoint::HeldExperts held;
  if (exchange_)
    held = [this](const ModelConfig& mc) {
      return held_experts(eplb_for(cfg_, mc), mc.num_moe_layers(), mc.num_experts,
                          exchange_->rank(), exchange_->ranks());
    };
  int threads =
      cfg_.threads > 0 ? cfg_.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  pool_ = std::make_unique<ThreadPool>(threads);
  const auto started = std::chrono::steady_clock::now();
  if (!ckpt_) {
    ckpt_ = Checkpoint::open(cfg_.model, held, pool_.get());
    startup_.open_seconds = seconds_since(started);
    startup_.read_seconds = ckpt_->load_figures().read_seconds;
    startup_.pack_seconds = ckpt_->load_figures().pack_seconds;
  }
  const auto built = std::chrono::steady_clock::now();
  const ModelConfig& mc = ckpt_->config();
  const std::string tok_dir = cfg_.tokenizer.empty() ? cfg_.model : cfg_.tokenizer;
  if (!cfg_.tokenizer.empty() || text::Tokenizer::present(tok_dir)) {
    tokenizer_ = text::Tokenizer::load(tok_dir);
    if (tokenizer_->vocab_size() > mc.vocab_size)
      throw Error(tok_dir + ": the tokenizer has " + std::to_string(tokenizer_->vocab_size()) +
                  " tokens but the model's vocab_size is " + std::to_string(mc.vocab_size));
  }
  // Gated DeltaNet layers keep a state per request, not per block: a prefix hit restores the
  // state at its end from a snapshot (engine/state_snapshots.h), so hybrids need some.
  if (cfg_.max_state_snapshots < -1)
    throw Error("max_state_snapshots must be >= 0 (or -1: 2 x max_num_seqs)");
  if (cfg_.max_state_snapshots < 0) cfg_.max_state_snapshots = 2 * cfg_.max_num_seqs;
  if (!mc.hybrid() || !cfg_.enable_prefix_caching) cfg_.max_state_snapshots = 0;
  const DType kv_dtype = resolve_kv_cache_dtype(cfg_.kv_cache_dtype, ckpt_->weights());
  cfg_.kv_cache_dtype = kv_dtype == DType::BF16 ? "bf16" : "fp32";
  int max_step = cfg_.max_num_batched_tokens;
  for (int b : cfg_.decode_buckets) max_step = std::max(max_step, b);
  // Sliding-window layers keep their KV in a pool of their own, sized for what the running
  // requests' windows and one step's tokens can hold at once (Scheduler).
  int window = 0, sliding_layers = 0;
  for (const LayerConfig& l : mc.layers)
    if (l.attention.sliding_window > 0)
      window = std::max(window, l.attention.sliding_window), ++sliding_layers;
  const int kv_layers = mc.num_layers - mc.num_deltanet_layers();  // DeltaNet layers hold no KV
  const int bs = cfg_.block_size, S = cfg_.max_num_seqs;
  const int64_t window_need =
      int64_t(S) * ((window - 1 + bs - 1) / bs + 3) + (max_step + bs - 1) / bs;
  const size_t per_layer_block =
      size_t(bs) * size_t(mc.kv_cache_width()) * dtype_size(kv_dtype);  // bytes
  int blocks = cfg_.num_kv_blocks;
  if (blocks <= 0) {
    const size_t budget = size_t(cfg_.kv_cache_mb) * (1u << 20),
                 full = size_t(kv_layers - sliding_layers);
    // blocks x full layers + min(blocks, window_need) x sliding layers within the budget.
    size_t b = budget / (size_t(kv_layers) * per_layer_block);
    if (sliding_layers && full && b > size_t(window_need))
      b = (budget - size_t(window_need) * size_t(sliding_layers) * per_layer_block) /
          (full * per_layer_block);
    blocks = int(std::clamp<size_t>(b, 16, 1 << 16));
  }
  cfg_.num_kv_blocks = blocks;
  const int window_blocks = window > 0 ? int(std::min<int64_t>(blocks, window_need)) : 0;
  // The pool's memory is committed only as it is written (engine/kv_cache.h), so a pool larger
  // than the machine would start and fail later, mid-run: refuse it here instead. Each pool
  // holds one scratch block past its blocks.
  const double kv_mb = double(per_layer_block) *
                       (double(blocks + 1) * double(kv_layers - sliding_layers) +
                        double(window > 0 ? window_blocks + 1 : 0) * double(sliding_layers)) /
                       double(1 << 20);
  if (const double machine_mb = physical_memory_mb(); kv_mb > machine_mb)
    throw Error("the KV cache (" + std::to_string(blocks) +
                " blocks: " + std::to_string(int64_t(kv_mb)) +
                " MiB) exceeds this machine's memory (" + std::to_string(int64_t(machine_mb)) +
                " MiB): lower --num-kv-blocks or --kv-cache-mb");
  kv_ = std::make_unique<KvPool>(blocks, cfg_.block_size);
  if (window > 0) window_kv_ = std::make_unique<KvPool>(window_blocks, cfg_.block_size);
  if (cfg_.eplb_redundant_experts < 0 || cfg_.eplb_redundant_experts > mc.num_experts)
    throw Error("eplb_redundant_experts must be in [0, " + std::to_string(mc.num_experts) + "]");
  EplbMap eplb = eplb_for(cfg_, mc);
  if (exchange_ && exchange_->ranks() > (eplb.enabled() ? eplb.num_physical() : mc.num_experts))
    throw Error("expert_parallel " + std::to_string(exchange_->ranks()) + " exceeds the model's " +
                std::to_string(mc.num_experts) + " experts (plus EPLB replicas)");
  runner_ = std::make_unique<ModelRunner>(
      ckpt_, blocks, cfg_.block_size, max_step, cfg_.max_num_seqs, pool_.get(), kv_dtype,
      window_blocks, std::move(eplb), exchange_.get(), cfg_.max_state_snapshots);
  if (cfg_.max_state_snapshots > 0)
    snapshots_ = std::make_unique<StateSnapshots>(cfg_.max_state_snapshots);
  SchedulerConfig sc;
  sc.max_num_seqs = cfg_.max_num_seqs;
  sc.max_num_batched_tokens = cfg_.max_num_batched_tokens;
  sc.enable_prefix_caching = cfg_.enable_prefix_caching;
  sc.decode_buckets = cfg_.decode_buckets;
  sc.sliding_window = window;
  sc.state_slots = mc.hybrid();
  if (!cfg_.speculative_algorithm.empty()) {
    refuse_speculation_conflicts(mc);
    sc.num_draft_tokens = cfg_.speculative_num_draft_tokens;
    sc.speculative_max_batch = cfg_.speculative_disable_by_batch_size;
    sc.ngram.min_window = cfg_.speculative_ngram_min_match_window_size;
    sc.ngram.max_window = cfg_.speculative_ngram_max_match_window_size;
    // Hybrids: the recurrent state after each draft of each drafting request, so a rejected
    // draft's state can be undone (it has no per-position history, unlike KV).
    if (mc.hybrid())
      runner_->reserve_draft_states(
          std::min(cfg_.speculative_disable_by_batch_size, cfg_.max_num_seqs),
          cfg_.speculative_num_draft_tokens);
  }
  scheduler_ =
      std::make_unique<Scheduler>(sc, kv_.get(), runner_->scratch_block(), window_kv_.get(),
                                  runner_->window_scratch_block(), snapshots_.get());
  if (cfg_.enable_return_routed_experts) {
    assert_capturable(cfg_, mc, max_step);
    capturer_ = std::make_unique<RouteCapturer>(cfg_.overlap_scheduler ? 3 : 1, max_step,
                                                mc.num_moe_layers(), mc.top_k);
    routes_ =
        std::make_unique<RouteManager>(mc.num_moe_layers(), mc.top_k, blocks, cfg_.block_size);
  }
  // Every rank built its engine (or this throws) before a worker thread exists to be joined.
  if (exchange_) exchange_->started(true);
  if (cfg_.overlap_scheduler) worker_ = std::thread([this] { worker_loop(); });
  startup_.build_seconds = seconds_since(built);
  startup_.total_seconds = seconds_since(started);
  startup_.checkpoint_bytes = ckpt_->stored_bytes();
  startup_.kv_bytes = uint64_t(kv_mb * double(1 << 20));
  startup_.resident_mb = resident_mb();
}

void Engine::refuse_speculation_conflicts(const ModelConfig& mc) const {
  const std::string& a = cfg_.speculative_algorithm;
  if (a == "NEXTN" || a == "EAGLE" || a == "EAGLE3" || a == "MTP")
    throw Error("speculative_algorithm " + a +
                ": drafting with the checkpoint's MTP layers is not built yet (its layers are "
                "skipped when loading); use NGRAM");
  if (a != "NGRAM")
    throw Error("speculative_algorithm must be NGRAM (or empty: off), got \"" + a + "\"");
  if (cfg_.speculative_num_draft_tokens < 1 || cfg_.speculative_num_draft_tokens > 64)
    throw Error("speculative_num_draft_tokens must be in [1, 64], got " +
                std::to_string(cfg_.speculative_num_draft_tokens));
  const int lo = cfg_.speculative_ngram_min_match_window_size,
            hi = cfg_.speculative_ngram_max_match_window_size;
  if (lo < 1 || hi < lo || hi > 1024)
    throw Error(
        "speculative_ngram_min_match_window_size and _max_ must satisfy 1 <= min <= max <= "
        "1024, got " +
        std::to_string(lo) + " and " + std::to_string(hi));
  if (cfg_.speculative_disable_by_batch_size < 1)
    throw Error("speculative_disable_by_batch_size must be at least 1");
  // A draft follows the request's newest token, which an overlapped step has not sampled yet
  // when the next one is planned.
  if (cfg_.overlap_scheduler)
    throw Error(
        "speculative decoding with the overlap scheduler is not supported: a draft needs the "
        "token the step in flight is sampling; turn one of them off");
}

void Engine::set_drafter(Drafter d) {
  if (cfg_.speculative_algorithm.empty())
    throw Error("set_drafter: the engine was started without speculative decoding");
  if (!requests_.empty()) throw Error("set_drafter: requests are in flight");
  const int vocab = model_config().vocab_size;
  scheduler_->set_drafter(
      [d = std::move(d), vocab](const Request& r, int max_drafts, std::vector<int>& out) {
        out.clear();
        d(r, max_drafts, out);
        for (size_t i = 0; i < out.size(); ++i)
          if (out[i] < 0 || out[i] >= vocab) {
            out.resize(i);
            break;
          }
      });
}

uint64_t Engine::recurrent_state_bytes_per_request() const {
  return runner_->recurrent_state_bytes_per_request();
}

std::string StartupReport::line() const {
  char buf[400];
  std::snprintf(
      buf, sizeof buf,
      "weights %.2f GB in %.2f s (read %.2f s, packed %.2f s, checked %.2f s); KV pool %.2f GB "
      "(committed as written) and runner set up in %.2f s; %.2f s in all; resident %.0f MB",
      double(checkpoint_bytes) / 1e9, open_seconds, read_seconds, pack_seconds,
      std::max(0.0, open_seconds - read_seconds - pack_seconds), double(kv_bytes) / 1e9,
      build_seconds, total_seconds, resident_mb);
  return buf;
}

std::vector<double> Engine::resident_mb_by_rank() const {
  if (exchange_) return exchange_->resident_mb_by_rank();
  return {resident_mb()};
}

void Engine::refuse_under_expert_parallel(const char* what) const {
  if (exchange_)
    throw Error(std::string(what) +
                " is not supported with expert parallelism yet: it would have to reach every rank "
                "(docs/EXPERT_PARALLEL.md)");
}

void Engine::refuse_on_shared_checkpoint(const char* what) const {
  // The engine and its model runner are the checkpoint's own two owners; any other holds it too.
  if (ckpt_.use_count() > 2)
    throw Error(std::string(what) +
                ": this engine's checkpoint is shared with another engine or caller, and a refit "
                "from tensors would change it under them; refit from a checkpoint (update_weights) "
                "instead");
}

Engine::~Engine() {
  try {
    drain();
  } catch (...) {
  }
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
}

void Engine::submit(int buffer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_[buffer].done = false;
    jobs_[buffer].error = nullptr;
    queue_[(queue_head_ + queue_size_) % 2] = buffer;
    ++queue_size_;
  }
  cv_.notify_all();
}

CaptureSlot* Engine::wait_for(int buffer) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return jobs_[buffer].done; });
  if (jobs_[buffer].error) std::rethrow_exception(jobs_[buffer].error);
  return jobs_[buffer].slot;
}

void Engine::worker_loop() {
  for (;;) {
    int buffer;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || queue_size_ > 0; });
      if (queue_size_ == 0) return;
      buffer = queue_[queue_head_];
      queue_head_ = (queue_head_ + 1) % 2;
      --queue_size_;
    }
    CaptureSlot* slot = nullptr;
    std::exception_ptr error;
    try {
      slot = run_forward(buffer);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_[buffer].slot = slot;
      jobs_[buffer].error = error;
      jobs_[buffer].done = true;
    }
    cv_.notify_all();
  }
}

uint64_t Engine::add_request(std::vector<int> prompt, SamplingParams params, uint64_t group) {
  const ModelConfig& mc = model_config();
  refuse_mixed_weights();
  runner_->refuse_if_released();  // before queueing: a refused request leaves nothing behind
  if (prompt.empty()) throw FieldError("prompt", "prompt_token_ids is empty");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= mc.vocab_size)
      throw FieldError("prompt", "prompt token " + std::to_string(i) + " is " +
                                     std::to_string(prompt[i]) + ", outside the vocabulary [0, " +
                                     std::to_string(mc.vocab_size) + ")");
  params.validate(mc.vocab_size);
  const int64_t total = int64_t(prompt.size()) + params.max_tokens;
  if (total > mc.max_position_embeddings)
    throw FieldError("prompt", "prompt (" + std::to_string(prompt.size()) +
                                   " tokens) + max_tokens (" + std::to_string(params.max_tokens) +
                                   ") exceeds the model's " +
                                   std::to_string(mc.max_position_embeddings) + " positions");
  const int64_t blocks = (total + cfg_.block_size - 1) / cfg_.block_size;
  if (blocks > kv_->num_blocks())
    throw FieldError("prompt", "prompt + max_tokens needs " + std::to_string(blocks) +
                                   " KV blocks but the pool has " +
                                   std::to_string(kv_->num_blocks()));
  if (!params.stop.empty() && !tokenizer_)
    throw FieldError(
        "stop",
        "stop strings need a tokenizer (the checkpoint has no tokenizer.json; pass one with "
        "--tokenizer "
        "DIR, or use stop_token_ids)");
  if (params.return_routed_experts && !cfg_.enable_return_routed_experts)
    throw FieldError("return_routed_experts",
                     "return_routed_experts was requested but the engine was not started with "
                     "enable_return_routed_experts");
  if (params.prompt_logprobs_start > int64_t(prompt.size()))
    throw FieldError("prompt_logprobs_start",
                     "prompt_logprobs_start " + std::to_string(params.prompt_logprobs_start) +
                         " is past the prompt (" + std::to_string(prompt.size()) + " tokens)");
  if (params.max_tokens == 0 && prompt.size() < 2 && params.return_routed_experts)
    throw FieldError("max_tokens",
                     "max_tokens 0 with a one-token prompt has no route row to return");
  if (params.routed_experts_start > total - 1)
    throw FieldError("routed_experts_start",
                     "routed_experts_start " + std::to_string(params.routed_experts_start) +
                         " is past the last route row (" + std::to_string(total - 2) + ")");
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->group = group == kOwnGroup ? (uint64_t(1) << 63) | r->id : group;
  r->arrival = arrival_++;
  r->prompt = std::move(prompt);
  r->params = std::move(params);
  // Reserve what the request can grow to, so its steps do not reallocate.
  r->output.reserve(size_t(r->params.max_tokens));
  r->logprobs.reserve(size_t(r->params.max_tokens));
  r->versions.reserve(size_t(r->params.max_tokens));
  r->blocks.reserve(size_t(blocks));
  if (r->params.top_logprobs > 0) r->top.reserve(size_t(r->params.max_tokens));
  if (r->params.prompt_logprobs_start >= 0) {
    r->prompt_logprobs.assign(r->prompt.size(), std::numeric_limits<float>::quiet_NaN());
    if (r->params.top_logprobs > 0) r->prompt_top.assign(r->prompt.size(), TopLogprobs{});
  }
  r->block_hashes.reserve(size_t(blocks));
  if (r->params.return_routed_experts)
    routes_->open(r->id, int(total), r->params.return_routed_expert_weights);
  if (tokenizer_)
    r->detok = std::make_unique<text::IncrementalDetokenizer>(*tokenizer_, r->prompt,
                                                              r->params.skip_special_tokens);
  prompt_tokens_ += r->prompt.size();
  scheduler_->add(r.get());
  uint64_t id = r->id;
  requests_[id] = std::move(r);
  return id;
}

bool Engine::abort(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->status == RequestStatus::Finished) return false;
  if (aborted_set_.insert(id).second)
    aborted_.push_back(id);  // O(1): aborting n requests is linear
  return true;
}

bool Engine::has_unfinished() const { return !requests_.empty(); }

void Engine::finish_aborted(std::vector<RequestOutput>& out) {
  for (uint64_t id : aborted_) {
    auto it = requests_.find(id);
    if (it != requests_.end()) finish(it->second.get(), "abort", out);
  }
  aborted_.clear();
  aborted_set_.clear();
}

void Engine::drop_prefix_cache() {
  kv_->flush();
  if (snapshots_) snapshots_->flush();
  if (window_kv_) window_kv_->flush();
  if (routes_) routes_->invalidate_all();
}

std::vector<RequestOutput> Engine::apply_aborts() {
  drain();  // blocks freed below must not be written by a forward still in flight
  std::vector<RequestOutput> out = std::move(drained_);
  drained_.clear();
  finish_aborted(out);
  return out;
}

CaptureSlot* Engine::run_forward(int buffer) {
  CaptureSlot* slot = capturer_ ? capturer_->acquire(plans_[buffer].iter) : nullptr;
  try {
    sampler_.resolve_tokens(plans_[buffer], token_ids_);
    if (exchange_) exchange_->send_step(plans_[buffer], token_ids_.data());
    runner_->forward(plans_[buffer], token_ids_.data(), slot);
    sampler_.finish(plans_[buffer], *runner_, pool_.get(), results_[buffer]);
  } catch (...) {
    if (slot)
      capturer_->release(
          slot);  // a failed step must not keep its slot: the next would wait forever
    throw;
  }
  return slot;
}

RequestOutput Engine::make_output(const Request& r) {
  RequestOutput o;
  o.request_id = r.id;
  o.prompt_token_ids = r.prompt;
  o.token_ids = r.output;
  o.logprobs = r.logprobs;
  o.weight_versions = r.versions;
  o.finished = r.status == RequestStatus::Finished;
  o.text = r.text;
  o.stop_str = r.stop_str;
  if (!o.finished && !r.params.include_stop_str_in_output && !r.params.stop.empty()) {
    // Hold back what could be the start of a stop string, so a stream never shows text that a
    // match would then cut.
    size_t longest = 0;
    for (const std::string& s : r.params.stop) longest = std::max(longest, s.size());
    o.text.resize(r.text.size() > longest - 1 ? r.text.size() - (longest - 1) : 0);
    o.text.resize(text::utf8_stable_prefix(o.text));
  }
  o.finish_reason = r.finish_reason;
  o.num_preemptions = r.num_preemptions;
  o.num_cached_tokens = r.prefix_hit_tokens;
  o.top_logprobs = r.top;
  o.prompt_logprobs_start = r.params.prompt_logprobs_start;
  if (r.params.prompt_logprobs_start >= 0 && r.status == RequestStatus::Finished) {
    const size_t from = size_t(r.params.prompt_logprobs_start);
    o.prompt_logprobs.assign(r.prompt_logprobs.begin() + ptrdiff_t(from), r.prompt_logprobs.end());
    if (!r.prompt_top.empty())
      o.prompt_top_logprobs.assign(r.prompt_top.begin() + ptrdiff_t(from), r.prompt_top.end());
  }
  return o;
}

bool Engine::extend_text(Request* r, int token) {
  if (!r->detok) return false;
  const size_t before = r->detok->text().size();
  const size_t grown = r->detok->push(token);
  if (grown == 0) return false;
  const std::string& full = r->detok->text();
  // A match must end in the new bytes: search from where the longest stop string could start.
  size_t best = std::string::npos;
  const std::string* matched = nullptr;
  for (const std::string& s : r->params.stop) {
    const size_t from = before >= s.size() - 1 ? before - (s.size() - 1) : 0;
    const size_t at = full.find(s, from);
    if (at != std::string::npos && at < best) best = at, matched = &s;
  }
  if (!matched) {
    r->text.append(full, before, grown);
    return false;
  }
  r->text = full.substr(0, r->params.include_stop_str_in_output ? best + matched->size() : best);
  r->stop_str = *matched;
  return true;
}

void Engine::finish(Request* r, const std::string& reason, std::vector<RequestOutput>& out) {
  r->status = RequestStatus::Finished;
  r->finish_reason = reason;
  if (r->detok && r->stop_str.empty()) {
    const size_t before = r->detok->text().size();
    if (r->detok->finish()) r->text.append(r->detok->text(), before);
  }
  scheduler_->remove(r);
  RequestOutput o = make_output(*r);
  if (r->params.return_routed_experts && reason == "error") {
    routes_->close(r->id);  // a failed request returns no routes, not partial ones
  } else if (r->params.return_routed_experts) {
    ScopedNanoseconds timed{route_ns_};
    const int S = r->num_tokens();
    RouteArray routes;
    if (reason == "abort") {
      routes = routes_->assemble_computed(r->id, S, r->params.routed_experts_start);
    } else {
      uint64_t gaps = 0;
      routes = routes_->assemble(r->id, S, r->params.routed_experts_start, &gaps);
      if (gaps) o.routes_error = std::to_string(gaps) + " route rows are missing (marked -1)";
    }
    routes.moe_layers = model_config().moe_layers();
    routes.num_experts = model_config().num_experts;
    o.routed_experts = std::move(routes);
    routes_->close(r->id);
  }
  if (reason == "abort" || reason == "error")
    ++aborted_count_;
  else
    ++finished_;
  out.push_back(std::move(o));
  requests_.erase(r->id);
}

// KV computed under older weights is never published (refit), and the hash chains start from the
// weight version (KvPool::chain_root), so no prefix hit crosses a refit, flushed or not.
void Engine::publish_full_blocks(Request* r, int computed) {
  if (!cfg_.enable_prefix_caching || r->kv_version != weight_version_) return;
  const int bs = cfg_.block_size;
  block_tokens_.resize(size_t(bs));
  for (int b = int(r->block_hashes.size()); b < computed / bs; ++b) {
    for (int j = 0; j < bs; ++j) block_tokens_[size_t(j)] = r->token(b * bs + j);
    const uint64_t parent = b ? r->block_hashes[size_t(b - 1)] : KvPool::chain_root(r->kv_version);
    const uint64_t h = KvPool::chain_hash(parent, block_tokens_.data(), bs);
    kv_->publish(r->blocks[size_t(b)], h, block_tokens_.data());
    // Its sliding-window block, unless already released (a chunk longer than the window).
    if (window_kv_ && r->window_blocks[size_t(b)] >= 0)
      window_kv_->publish(r->window_blocks[size_t(b)], h, block_tokens_.data());
    r->block_hashes.push_back(h);
  }
}

void Engine::process(int buffer, CaptureSlot* slot, std::vector<RequestOutput>& out) {
  const StepPlan& plan = plans_[buffer];
  const StepResult& res = results_[buffer];
  if (slot) {
    ScopedNanoseconds timed{route_ns_};
    routes_->commit(plan, *slot);
    capturer_->release(slot);
  }
  const int eos = model_config().eos_token_id;
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const PlannedSeq& s = plan.seqs[i];
    auto it = requests_.find(s.request_id);
    if (it == requests_.end()) continue;  // finished or aborted meanwhile
    Request* r = it->second.get();
    if (r->epoch != s.epoch || r->status != RequestStatus::Running) continue;  // preempted since
    computed_tokens_ += uint64_t(s.num_tokens);
    const SeqResult& sr = res.seqs[i];
    // Positions whose KV stands. Speculative decoding: rejected drafts leave no trace: their KV
    // is rolled back and their route rows dropped, before anything below can read them.
    int valid = s.start_pos + s.num_tokens;
    if (s.num_drafts > 0) {
      valid -= s.num_drafts - sr.accepted;
      scheduler_->reject_drafts(r, s, sr.accepted);
      // A hybrid's recurrent state ran through every draft: back to the last accepted one.
      if (s.draft_slot >= 0 && sr.accepted < s.num_drafts)
        runner_->restore_draft_state(s.state_slot, s.draft_slot, sr.accepted);
      if (routes_) routes_->discard(plan, i, valid);
      draft_tokens_ += uint64_t(s.num_drafts);
      accepted_draft_tokens_ += uint64_t(sr.accepted);
    }
    // Publish blocks this step filled, so later requests can hit them (their routes are
    // committed above, before any hit can be planned); an accepted draft's block once its token
    // is part of the output.
    // Its recurrent-state snapshot goes under the hash of the block that ends where it was
    // taken, once that block is published (never, if its KV was computed under older weights or
    // the boundary lies in a rejected draft).
    bool snapshot_published = s.snapshot_write < 0;
    auto publish = [&] {
      publish_full_blocks(r, std::min(valid, r->num_tokens()));
      const size_t b = size_t((s.start_pos + s.snapshot_tokens) / cfg_.block_size - 1);
      if (!snapshot_published && b < r->block_hashes.size()) {
        snapshots_->publish(s.snapshot_write, r->block_hashes[b]);
        snapshot_published = true;
      }
    };
    publish();
    bool failed = false;
    for (int j = 0; j < s.score_count && !failed; ++j) {
      const ScoreTarget& t = plan.scores[size_t(s.score_offset + j)];
      const ScoreResult& sc = res.scores[size_t(s.score_offset + j)];
      if (sc.nonfinite) {
        finish(r, "error", out);
        out.back().error = "non-finite logits at position " + std::to_string(t.position - 1) +
                           " (NaN or infinite values in the weights or activations)";
        failed = true;
        break;
      }
      r->prompt_logprobs[size_t(t.position)] = sc.logprob;  // recompute rewrites the same bits
      if (!r->prompt_top.empty()) r->prompt_top[size_t(t.position)] = sc.top;
    }
    if (failed) continue;
    if (r->params.max_tokens == 0 && s.start_pos + s.num_tokens == int(r->prompt.size())) {
      finish(r, "length", out);  // prompt only: scored and routed, nothing sampled
      continue;
    }
    if (!sr.sampled) continue;
    --r->pending;
    // The sampled token, then one per accepted draft (speculative decoding), each checked for
    // the end of the request as if it had been sampled alone.
    bool ended = false;
    for (size_t e = 0; e <= sr.more.size() && !ended; ++e) {
      const Sample& sample = e == 0 ? sr.sample : sr.more[e - 1];
      if (sample.nonfinite) {
        const int pos = r->num_tokens() - 1;
        publish();
        finish(r, "error", out);
        out.back().error =
            "non-finite logits at position " + std::to_string(pos) +
            " (NaN or infinite values in the weights or activations); nothing was sampled";
        ended = true;
        break;
      }
      r->output.push_back(sample.token);
      r->logprobs.push_back(sample.logprob);
      if (r->params.top_logprobs > 0) r->top.push_back(sample.top);
      r->versions.push_back(plan.weight_version);
      ++generated_tokens_;
      const int tok = sample.token;
      const auto& stops = r->params.stop_token_ids;
      const char* reason = nullptr;
      if ((!r->params.ignore_eos && tok == eos) ||
          std::find(stops.begin(), stops.end(), tok) != stops.end() || extend_text(r, tok))
        reason = "stop";
      else if (int(r->output.size()) >= r->params.max_tokens)
        reason = "length";
      if (reason) {
        publish();
        finish(r, reason, out);
        ended = true;
      }
    }
    if (!ended) {
      publish();
      out.push_back(make_output(*r));
      if (r->params.stream_routes && r->params.return_routed_experts) {
        // The rows computed since its previous output (the prompt's with the first token), up to
        // the newest token's, whose row the next step computes. Rows before `from` went out, so
        // the scan for the first unwritten row starts there.
        ScopedNanoseconds timed{route_ns_};
        const int from = std::max(r->routes_streamed, r->params.routed_experts_start);
        RouteArray rows = routes_->assemble_computed(r->id, r->num_tokens(), from, from);
        r->routes_streamed = from + rows.rows;
        rows.moe_layers = model_config().moe_layers();
        rows.num_experts = model_config().num_experts;
        out.back().routed_experts = std::move(rows);
      }
    }
  }
}

std::vector<RequestOutput> Engine::step() {
  std::vector<RequestOutput> out = std::move(drained_);
  drained_.clear();
  finish_aborted(out);
  // The plan goes into the buffer the step in flight (if any) is not using.
  const int buffer = in_flight_ == 0 ? 1 : 0;
  scheduler_->schedule(plans_[buffer], next_iter_, weight_version_);
  const bool has_plan = !plans_[buffer].tokens.empty();
  if (has_plan) ++next_iter_;
  out.reserve(out.size() + plans_[buffer].seqs.size() +
              (in_flight_ >= 0 ? plans_[in_flight_].seqs.size() : 0));
  if (!cfg_.overlap_scheduler) {
    if (has_plan) process(buffer, run_forward(buffer), out);
    return out;
  }
  // Overlap: queue this step behind the one in flight, then process the one in flight while
  // this one computes.
  if (has_plan) submit(buffer);
  if (in_flight_ >= 0) {
    const int prev = in_flight_;
    in_flight_ = -1;
    process(prev, wait_for(prev), out);
  }
  if (has_plan) in_flight_ = buffer;
  return out;
}

void Engine::drain() {
  if (in_flight_ < 0) return;
  const int prev = in_flight_;
  in_flight_ = -1;
  process(prev, wait_for(prev), drained_);
}

std::vector<RequestOutput> Engine::generate(const std::vector<std::vector<int>>& prompts,
                                            const std::vector<SamplingParams>& params) {
  if (params.size() != prompts.size() && params.size() != 1)
    throw Error("generate: give one SamplingParams or one per prompt");
  std::vector<uint64_t> ids;
  try {
    for (size_t i = 0; i < prompts.size(); ++i)
      ids.push_back(add_request(prompts[i], params.size() == 1 ? params[0] : params[i]));
  } catch (const Error& e) {
    // One bad prompt refuses the whole call: the ones already queued are withdrawn, so nothing
    // of this call lingers into the next one.
    for (uint64_t id : ids) abort(id);
    auto withdrawn = [&] {
      for (uint64_t id : ids)
        if (requests_.count(id)) return false;
      return in_flight_ < 0;
    };
    while (!withdrawn()) step();
    throw Error("prompt " + std::to_string(ids.size()) + ": " + e.what());
  }
  std::map<uint64_t, RequestOutput> done;
  while (done.size() < ids.size()) {
    for (auto& o : step())
      if (o.finished) done[o.request_id] = std::move(o);
    if (!has_unfinished() && in_flight_ < 0 && done.size() < ids.size()) break;
  }
  std::vector<RequestOutput> out;
  for (uint64_t id : ids) out.push_back(std::move(done.at(id)));
  return out;
}

void Engine::update_weights(const std::string& dir, bool flush) {
  refuse_under_expert_parallel("update_weights (refit)");  // before reading the new checkpoint
  update_weights_from_headers(Checkpoint::headers(dir), flush);
}

void Engine::update_weights_from_headers(const std::shared_ptr<Checkpoint>& next, bool flush) {
  refuse_under_expert_parallel("update_weights (refit)");
  const std::string& dir = next->dir();
  if (ckpt_.use_count() > 2 || ckpt_->panels_released()) {
    // Another engine serves this checkpoint, or its weights hold no memory: a checkpoint of the
    // engine's own, each tensor checked for NaN and infinity as it is read (a refused refit
    // leaves the old weights serving).
    update_weights(Checkpoint::open(dir, {}, pool_.get(), /*refuse_non_finite=*/true), flush);
    return;
  }
  // In place, a layer at a time (never a second copy of the weights). Everything that needs no
  // weight value is checked first, while the old weights still serve.
  refuse_model_change(*next);
  ckpt_->check_refit(*next);
  drain();
  try {
    ckpt_->refit_from(*next, pool_.get());
  } catch (const std::exception& e) {
    // Some layers are new and the rest old: no silent mix is served. Running requests end
    // (reason abort) and new ones are refused, naming this refit, until a refit succeeds.
    failed_refit_ = "update_weights: the refit from " + dir +
                    " failed after the served weights began to change (" + e.what() +
                    "); requests are refused until a refit succeeds";
    runner_->set_weights(ckpt_);
    abort_unfinished();
    forget_bucket_refit();
    throw Error(failed_refit_);
  }
  failed_refit_.clear();
  forget_bucket_refit();
  runner_->set_weights(ckpt_);
  ++weight_version_;
  if (flush) drop_prefix_cache();
}

void Engine::refuse_model_change(const Checkpoint& next) const {
  // The engine's buffers, tables (RoPE) and admission limits come from the served model's
  // description: a refit may change weights only. A refused refit leaves the old weights serving.
  const std::vector<std::string> diffs = ckpt_->differences(next);
  if (diffs.empty()) return;
  std::string msg =
      "update_weights: " + next.dir() + " describes a different model than the one served (";
  for (size_t i = 0; i < diffs.size(); ++i) msg += (i ? "; " : "") + diffs[i];
  throw Error(msg + "); start a new engine for it");
}

void Engine::update_weights(std::shared_ptr<Checkpoint> ckpt, bool flush) {
  refuse_under_expert_parallel("update_weights (refit)");
  refuse_model_change(*ckpt);
  ckpt->refuse_non_finite_values();  // before anything changes: a refused refit leaves the old
                                     // weights
  drain();
  ckpt_ = ckpt;
  runner_->set_weights(ckpt);
  failed_refit_.clear();
  forget_bucket_refit();
  ++weight_version_;
  if (flush) drop_prefix_cache();
}

void Engine::stage_weights(std::vector<TensorToWrite> tensors) {
  refuse_under_expert_parallel("update_weights_from_tensors (refit)");
  refuse_on_shared_checkpoint("update_weights_from_tensors (refit)");
  ckpt_->check_update(tensors);  // a refused bucket changes nothing
  for (TensorToWrite& t : tensors) {
    refit_sent_.insert(t.name);
    std::string name = t.name;
    staged_[name] = std::move(t);
  }
  // Released weights have no panels to write into: the buckets wait for the last one (they are
  // then the only copy of the weights).
  if (ckpt_->panels_released()) return;
  // Each tensor goes into its panels as soon as the tensors it is packed with have arrived too,
  // so the refit holds about one bucket beyond the resident weights, never a second copy.
  std::vector<std::string> ready;
  for (const auto& [name, t] : staged_) {
    bool together = true;
    for (const std::string& other : ckpt_->sent_together(name))
      together = together && staged_.count(other);
    if (together) ready.push_back(name);
  }
  if (ready.empty()) return;
  std::vector<TensorToWrite> bucket;
  for (const std::string& name : ready) {
    bucket.push_back(std::move(staged_.at(name)));
    staged_.erase(name);
  }
  if (!refit_in_place_) {
    // From here until the last bucket the served weights are part old, part new: nothing runs on
    // them. Running requests end now (reason abort, their partial outputs returned), new ones are
    // refused naming this refit (refuse_mixed_weights).
    drain();
    abort_unfinished();
    refit_in_place_ = true;
  }
  try {
    apply_sent(std::move(bucket));
  } catch (const std::exception& e) {
    failed_refit_ = "update_weights_from_tensors: a bucket failed while being applied (" +
                    std::string(e.what()) + "); requests are refused until a refit succeeds";
    forget_bucket_refit();
    throw Error(failed_refit_);
  }
}

void Engine::commit_staged_weights(bool flush) {
  if (refit_sent_.empty()) throw Error("update_weights_from_tensors: no tensors were staged");
  std::vector<TensorToWrite> rest;
  rest.reserve(staged_.size());
  for (auto& [name, t] : staged_) rest.push_back(std::move(t));
  staged_.clear();
  // After a failed refit only one that sends every weight makes the served weights one set again.
  bool every_weight = true;
  for (const std::string& name : ckpt_->used_tensors())
    every_weight = every_weight && refit_sent_.count(name);
  const size_t sent = refit_sent_.size();
  const bool mixed = refit_in_place_;
  refit_sent_.clear();  // refused or applied, this set of buckets is done
  refit_in_place_ = false;
  try {
    refuse_on_shared_checkpoint("update_weights_from_tensors (refit)");
    drain();
    if (!rest.empty()) apply_sent(std::move(rest));
  } catch (const std::exception& e) {
    if (!mixed) throw;  // nothing changed: the old weights serve on
    failed_refit_ = "update_weights_from_tensors: the last bucket was refused (" +
                    std::string(e.what()) + ") after " + std::to_string(sent) +
                    " tensors of earlier buckets had changed the served weights; requests "
                    "are refused until a refit succeeds";
    throw Error(failed_refit_);
  }
  if (every_weight) failed_refit_.clear();
  ++weight_version_;
  if (flush) drop_prefix_cache();
}

void Engine::apply_sent(std::vector<TensorToWrite> tensors) {
  // The checkpoint packs the sent bytes into the panels they replace (only those tensors' panels
  // change). What they replaced is freed on a side thread, so the munmap of gigabytes is not
  // part of the refit.
  Checkpoint::Update update = ckpt_->apply_update(std::move(tensors), pool_.get());
  runner_->set_weights(ckpt_);
  if (freeing_replaced_.valid()) freeing_replaced_.wait();
  freeing_replaced_ =
      std::async(std::launch::async, [old = std::move(update.replaced)]() mutable { old.clear(); });
}

void Engine::abort_unfinished() {
  std::vector<uint64_t> ids;
  for (const auto& [id, request] : requests_) ids.push_back(id);
  for (uint64_t id : ids) abort(id);
}

void Engine::forget_bucket_refit() {
  staged_.clear();
  refit_sent_.clear();
  refit_in_place_ = false;
}

void Engine::refuse_mixed_weights() const {
  if (!failed_refit_.empty()) throw Error(failed_refit_);
  if (refit_in_place_)
    throw Error("update_weights_from_tensors: a refit in buckets is under way (" +
                std::to_string(refit_sent_.size()) +
                " tensors sent, applied in place): requests are refused until its last bucket "
                "(finished=true) lands");
}

bool Engine::reset_prefix_cache() {
  if (has_unfinished()) return false;
  drain();
  drop_prefix_cache();
  return true;
}

int Engine::retract_all() {
  drain();
  return scheduler_->retract_all();
}

void Engine::release_memory(bool kv_cache, bool weights) {
  refuse_under_expert_parallel("release_memory_occupation");
  if (has_unfinished())
    throw Error(
        "release_memory_occupation: requests are running or waiting (pause with mode abort, or "
        "wait)");
  drain();
  if (kv_cache) {
    runner_->release_kv_cache();
    drop_prefix_cache();  // the cached blocks' contents are gone
  }
  if (weights) {
    refuse_on_shared_checkpoint("release_memory_occupation of the weights");
    runner_->release_packed_weights();
    ckpt_->release_panels();  // the only copy: resume reads the files again
  }
  if (freeing_replaced_.valid())
    freeing_replaced_.wait();  // the last refit's old storage goes back too
  // Freed heap pages stay in malloc's arenas unless handed back explicitly.
  malloc_trim(0);
}

void Engine::resume_memory(bool kv_cache, bool weights) {
  if (kv_cache) runner_->restore_kv_cache();
  if (weights && ckpt_->panels_released()) {
    // Weights a refit sent from memory are on no disk: they stay released until the trainer
    // sends them again (SGLang's resume-then-update order); generating is refused until then.
    if (ckpt_->updated_in_memory()) return;
    ckpt_ = ckpt_->reload(pool_.get());  // refused when the files changed since they were read
    runner_->set_weights(ckpt_);
  }
}

void Engine::rebalance_eplb() {
  refuse_under_expert_parallel("rebalance_eplb");
  if (cfg_.eplb_redundant_experts <= 0)
    throw Error("rebalance_eplb: the engine was started without EPLB");
  drain();
  const ModelConfig& mc = model_config();
  runner_->set_eplb(EplbMap(mc.num_moe_layers(), mc.num_experts, cfg_.eplb_redundant_experts,
                            runner_->expert_load()));
}

EngineStats Engine::stats() const {
  EngineStats s;
  s.block_size = cfg_.block_size;
  s.kv_cache_dtype = cfg_.kv_cache_dtype;
  const SchedulerStats& ss = scheduler_->stats();
  s.steps = ss.steps;
  s.preemptions = ss.preemptions;
  s.prefix_hit_tokens = ss.prefix_hit_tokens;
  s.prefix_queried_tokens = ss.prefix_queried_tokens;
  s.chunked_prefills = ss.chunked_prefills;
  s.padded_tokens = ss.padded_tokens;
  s.prompt_tokens = prompt_tokens_;
  s.generated_tokens = generated_tokens_;
  s.computed_tokens = computed_tokens_;
  s.requests_finished = finished_;
  s.requests_aborted = aborted_count_;
  s.weight_version = weight_version_;
  s.weight_bytes_read = runner_->weight_bytes_read();
  s.spec_draft_tokens = draft_tokens_;
  s.spec_accepted_tokens = accepted_draft_tokens_;
  s.spec_steps_off = ss.speculative_steps_off;
  s.spec_draft_state_bytes = runner_->draft_state_bytes();
  s.running = scheduler_->num_running();
  s.waiting = scheduler_->num_waiting();
  s.free_blocks = kv_->num_free();
  s.num_blocks = kv_->num_blocks();
  s.published_blocks = kv_->publishes();
  if (snapshots_) {
    s.state_snapshots = snapshots_->capacity();
    s.state_snapshots_held = snapshots_->num_published();
    s.state_snapshots_taken = snapshots_->published();
    s.state_snapshot_bytes = uint64_t(snapshots_->capacity()) * recurrent_state_bytes_per_request();
  }
  s.recurrent_state_bytes_per_request = recurrent_state_bytes_per_request();
  s.state_snapshot_restores = ss.snapshot_restores;
  s.state_snapshot_cut_tokens = ss.snapshot_cut_tokens;
  if (window_kv_)
    s.free_window_blocks = window_kv_->num_free(), s.num_window_blocks = window_kv_->num_blocks();
  s.window_blocks_freed = ss.window_blocks_freed;
  s.expert_load = runner_->expert_load();
  s.physical_expert_load = runner_->physical_expert_load();
  s.moe_layers = model_config().moe_layers();
  if (capturer_) s.capture_waits = capturer_->waits();
  s.route_seconds = double(route_ns_) * 1e-9;
  s.attention_seconds = double(runner_->attention_ns()) * 1e-9;
  s.deltanet_seconds = double(runner_->deltanet_ns()) * 1e-9;
  if (routes_) {
    const RouteStats& rs = routes_->stats();
    s.routed_experts_gaps = rs.gaps;
    s.route_rows_committed = rs.rows_committed;
    s.prefix_route_rows_copied = rs.prefix_rows_copied;
    s.stale_prefix_rows = rs.stale_prefix_rows;
    s.route_bytes_returned = rs.route_bytes_returned;
  }
  return s;
}

}  // namespace r3
