// The one thread that owns the Engine. Its callers (the HTTP threads, the Python AsyncLLM) never
// call the engine: they post commands (add requests, abort, refit, read stats) to a queue this
// thread drains between steps, and wait on a Channel for their outputs. While any request is
// unfinished the thread steps the engine; otherwise it sleeps on the queue.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "engine/engine.h"
#include "serving/channel.h"
#include "serving/serving_error.h"

namespace r3::serving {

struct Job {
  std::vector<int> prompt;
  SamplingParams params;
};

// add_request refused job `index` of a submission (none of the submission stays queued); `field`
// is the request field it concerns (FieldError's, r3's name), or "".
struct SubmitError : std::runtime_error {
  SubmitError(size_t i, const std::string& m, std::string f = "")
      : std::runtime_error(m), index(i), field(std::move(f)) {}
  size_t index;
  std::string field;
};

// Step latency histogram (seconds), Prometheus style: cumulative counts per upper bound.
struct StepLatency {
  static constexpr double kBounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                       0.1,    0.25,  0.5,    1.0,   2.5,  5.0};
  std::vector<uint64_t> buckets = std::vector<uint64_t>(std::size(kBounds), 0);  // not cumulative
  uint64_t count = 0;
  double sum = 0.0;
  void add(double s) {
    for (size_t i = 0; i < std::size(kBounds); ++i)
      if (s <= kBounds[i]) {
        ++buckets[i];
        break;
      }
    ++count;
    sum += s;
  }
};

struct LoopStats {
  EngineStats engine;
  StepLatency step_latency;
  size_t in_flight = 0;      // engine requests with a waiting HTTP call
  std::string weight_label;  // the weight version label
  bool paused = false;
};

class EngineLoop {
 public:
  // Builds the engine (throws r3::Error) and starts the loop thread.
  explicit EngineLoop(EngineConfig cfg);
  // Stops the loop (shutdown()); the engine is freed.
  ~EngineLoop();
  // Ends the loop thread: pending and later calls fail with "server shutting down" (ServingError
  // Unavailable). Idempotent, any thread but the loop's.
  void shutdown();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  const ModelConfig& model_config() const { return model_; }
  const StartupReport& startup() const { return startup_; }
  // The model's tokenizer (thread-safe to use from any thread), or null.
  std::shared_ptr<const text::Tokenizer> tokenizer() const { return tokenizer_; }
  const EngineConfig& engine_config() const { return cfg_; }

  // Queues every job under the external id rid (unique among calls in flight); outputs go to
  // ch, choice i = jobs[i]. Returns the engine ids. Throws SubmitError (nothing queued),
  // ServingError BadRequest (field "rid") for a duplicate rid, Unavailable when the engine failed.
  std::vector<uint64_t> submit(std::vector<Job> jobs, std::shared_ptr<Channel> ch,
                               const std::string& rid);
  // Aborts every request of rid; returns how many were still running.
  size_t abort_rid(const std::string& rid);
  size_t abort_all();
  void abort(const std::vector<uint64_t>& ids);
  // Refit from a checkpoint directory (read here, on the caller's thread); `label` becomes the
  // weight version label (default: the refit counter in decimal). With abort_all, requests in
  // flight are aborted first. Returns the new counter (throws r3::Error).
  uint64_t update_weights(const std::string& dir, bool flush_cache,
                          const std::optional<std::string>& label = {}, bool abort_all = false);
  // In-memory refit from safetensors bytes (parsed and checked on the calling thread; the bytes
  // are freed once parsed, so a body costs twice its size at most): the tensors are staged; with
  // `finished` every staged tensor is applied between two steps and the counter (and label) move
  // on. Returns {tensors staged so far or applied, the counter}.
  std::pair<size_t, uint64_t> update_weights_from_tensors(std::string&& safetensors_bytes,
                                                          bool flush_cache,
                                                          const std::optional<std::string>& label,
                                                          bool finished, bool abort_all);
  // The first bytes of a safetensors body as they arrive: false until its header is complete,
  // then true once the header names only tensors the served model holds, with their dtypes and
  // shapes (throws r3::Error naming the first that does not), so a bad body is refused before
  // its data is read.
  bool check_tensor_body_start(std::string_view received) const;
  std::pair<size_t, uint64_t> update_weights_from_tensors(std::vector<TensorToWrite> tensors,
                                                          bool flush_cache,
                                                          const std::optional<std::string>& label,
                                                          bool finished, bool abort_all);
  // The weight version label SGLang clients compare (a string); set by refits.
  std::string weight_label() const;
  void set_weight_label(const std::string& label);

  // SGLang's control plane. pause: "abort" ends every request (finish reason abort), "in_place"
  // keeps them (and their KV) waiting, "retract" frees their KV (recomputed on continue); in
  // every mode no step runs (new requests queue) until continue_generation().
  void pause_generation(const std::string& mode);
  void continue_generation();
  bool paused() const { return paused_.load(); }
  // Drops the prefix cache; false (nothing done) while requests are running or waiting.
  bool flush_cache();
  // Gives memory back to the OS (engine idle, else r3::Error) and rebuilds it; no step runs
  // while anything is released.
  void release_memory(bool kv_cache, bool weights);
  void resume_memory(bool kv_cache, bool weights);
  bool memory_released() const { return released_.load(); }
  LoopStats stats();
  // Empty while the engine is healthy; the error that stopped it otherwise.
  std::string failure() const;
  // Seconds the step now running has been running (0 when the loop is between steps): a step
  // that never ends (a hung kernel, a deadlock) shows here while /health reports it.
  double seconds_in_step() const;
  // Graceful stop: new submissions are refused at once (Unavailable); requests in flight run to
  // completion until `grace` has passed, then the rest are aborted (their callers get an "abort"
  // reply). Returns how many were aborted. The loop keeps running; shutdown() ends it.
  size_t drain(std::chrono::milliseconds grace);
  uint64_t weight_version() const { return weight_version_.load(); }

 private:
  struct Target {
    std::shared_ptr<Channel> ch;
    size_t choice;
    std::string rid;
  };
  // Runs f(engine) on the loop thread and waits for its result (exceptions travel back).
  template <class F>
  auto call(F f) -> decltype(f()) {
    using R = decltype(f());
    // Any command may give memory back or fill it again (release, resume, a refit that brings
    // released weights back): the loop's view of it is refreshed after each, thrown or not.
    auto task = std::make_shared<std::packaged_task<R()>>([this, f = std::move(f)]() mutable -> R {
      struct Refresh {
        EngineLoop* loop;
        ~Refresh() { loop->released_ = loop->engine_->memory_released(); }
      } refresh{this};
      return f();
    });
    auto fut = task->get_future();
    post([task] { (*task)(); });
    // An exception is rethrown as a deep copy owned by this thread: the original (and its
    // message, which runtime_error's copies share) lives in the shared state, which the loop
    // thread may free last, through reference counts ThreadSanitizer cannot see in libstdc++.
    try {
      return fut.get();
    } catch (const SubmitError& e) {
      throw SubmitError(e.index, std::string(e.what()), std::string(e.field));
    } catch (const ServingError& e) {
      throw ServingError(e.kind(), std::string(e.what()), std::string(e.field()));
    } catch (const Error& e) {
      throw Error(std::string(e.what()));
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string(e.what()));
    }
  }
  void post(std::function<void()> cmd);
  void run();
  void step_once();
  size_t abort_targets();  // loop thread: aborts every request with a waiting caller
  void deliver(std::vector<RequestOutput>& outs);  // to each output's waiting caller
  void fail_all(const std::string& why);
  void forget(uint64_t id);

  EngineConfig cfg_;
  ModelConfig model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const text::Tokenizer> tokenizer_;
  std::map<std::string, TensorView>
      catalog_;               // the served tensors' descriptions (Checkpoint::catalog)
  uint64_t submissions_ = 0;  // loop thread: the fairness group of each submit()
  StartupReport startup_;     // the engine's, copied before the loop starts
  // Loop-thread state.
  std::map<uint64_t, Target> targets_;
  std::map<std::string, std::vector<uint64_t>> rids_;
  StepLatency latency_;
  bool kick_ = false;  // step once even when idle (delivers outputs drained by a refit)
  // Shared state.
  mutable std::mutex mu_;
  std::mutex join_mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  bool stop_ = false;
  bool draining_ = false;  // refuse new submissions (graceful stop under way)
  std::atomic<bool> paused_{false};
  std::atomic<bool> released_{false};  // memory given back: no step may run
  std::string weight_label_;           // under mu_
  std::string failure_;
  std::atomic<int64_t> step_started_ns_{
      0};  // steady clock at the start of the running step, 0 = none
  std::atomic<uint64_t> weight_version_{0};
  std::thread thread_;
};

}  // namespace r3::serving
