#include "serving/engine_loop.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "core/seconds_since.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "serving/serving_error.h"

namespace r3::serving {

EngineLoop::EngineLoop(EngineConfig cfg) : cfg_(std::move(cfg)) {
  engine_ = std::make_unique<Engine>(cfg_);
  cfg_ = engine_->config();  // as resolved (KV blocks, cache dtype)
  weight_label_ = "0";
  model_ = engine_->model_config();
  tokenizer_ = engine_->tokenizer();
  catalog_ = engine_->checkpoint().catalog();
  startup_ = engine_->startup();
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() { shutdown(); }

void EngineLoop::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  std::lock_guard<std::mutex> lk(join_mu_);
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::post(std::function<void()> cmd) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) throw unavailable("server shutting down");
    commands_.push_back(std::move(cmd));
  }
  cv_.notify_all();
}

std::string EngineLoop::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

std::vector<uint64_t> EngineLoop::submit(std::vector<Job> jobs, std::shared_ptr<Channel> ch,
                                         const std::string& rid) {
  if (!failure().empty()) throw unavailable("the engine failed: " + failure());
  return call([&]() -> std::vector<uint64_t> {
    if (draining_) throw unavailable("server shutting down: not accepting new requests");
    if (rids_.count(rid)) throw bad_call("request id \"" + rid + "\" is already in flight", "rid");
    std::vector<uint64_t> ids;
    const uint64_t group = ++submissions_;  // its jobs wait together; submissions take turns
    for (size_t i = 0; i < jobs.size(); ++i) {
      try {
        ids.push_back(engine_->add_request(std::move(jobs[i].prompt), jobs[i].params, group));
      } catch (const Error& e) {
        for (uint64_t id : ids) engine_->abort(id);  // their outputs go nowhere: no target
        const auto* named = dynamic_cast<const FieldError*>(&e);
        throw SubmitError(i, e.what(), named ? named->field() : "");
      }
    }
    for (size_t i = 0; i < ids.size(); ++i) targets_[ids[i]] = Target{ch, i, rid};
    rids_[rid] = ids;
    return ids;
  });
}

size_t EngineLoop::abort_rid(const std::string& rid) {
  return call([&]() -> size_t {
    auto it = rids_.find(rid);
    if (it == rids_.end()) return 0;
    size_t n = 0;
    for (uint64_t id : it->second) n += engine_->abort(id) ? 1 : 0;
    return n;
  });
}

size_t EngineLoop::abort_all() {
  return call([&] { return abort_targets(); });
}

size_t EngineLoop::abort_targets() {
  size_t n = 0;
  for (auto& [id, t] : targets_) n += engine_->abort(id) ? 1 : 0;
  return n;
}

void EngineLoop::abort(const std::vector<uint64_t>& ids) {
  try {
    post([this, ids] {
      for (uint64_t id : ids) engine_->abort(id);
    });
  } catch (const ServingError&) {
    // Shutting down: everything is being aborted anyway.
  }
}

uint64_t EngineLoop::update_weights(const std::string& dir, bool flush_cache,
                                    const std::optional<std::string>& label, bool abort_all) {
  if (!failure().empty()) throw unavailable("the engine failed: " + failure());
  // The description and headers are read on the calling (HTTP) thread, so a slow or bad path
  // never stalls the engine loop; the weights are then read and packed in place between two
  // steps, a layer at a time (generation waits for that: no second copy of the weights is held).
  engine_->refuse_under_expert_parallel("update_weights (refit)");
  std::shared_ptr<Checkpoint> headers = Checkpoint::headers(dir);
  const uint64_t v = call([&]() -> uint64_t {
    if (abort_all) abort_targets();
    engine_->update_weights_from_headers(headers, flush_cache);
    kick_ = true;
    weight_version_ = engine_->weight_version();
    return engine_->weight_version();
  });
  set_weight_label(label ? *label : std::to_string(v));
  return v;
}

bool EngineLoop::check_tensor_body_start(std::string_view received) const {
  std::optional<std::vector<TensorView>> declared =
      SafetensorsFile::declared_tensors(received, "update_weights_from_tensor body");
  if (!declared) return false;
  for (TensorView& t : *declared) {
    auto have = catalog_.find(t.name);
    Checkpoint::check_sent_tensor(have == catalog_.end() ? nullptr : &have->second, t.name, t.dtype,
                                  t.shape);
  }
  return true;
}

std::pair<size_t, uint64_t> EngineLoop::update_weights_from_tensors(
    std::string&& bytes, bool flush_cache, const std::optional<std::string>& label, bool finished,
    bool abort_all) {
  if (!failure().empty()) throw unavailable("the engine failed: " + failure());
  engine_->refuse_under_expert_parallel("update_weights_from_tensors (refit)");
  std::unique_ptr<SafetensorsFile> f =
      SafetensorsFile::from_bytes(bytes, "update_weights_from_tensor body");
  std::string().swap(bytes);  // the parsed copy holds every tensor now: give the body back
  std::vector<TensorToWrite> tensors;
  for (auto& [name, t] : f->tensors()) tensors.push_back(copy_tensor(t));
  f.reset();
  return update_weights_from_tensors(std::move(tensors), flush_cache, label, finished, abort_all);
}

std::pair<size_t, uint64_t> EngineLoop::update_weights_from_tensors(
    std::vector<TensorToWrite> tensors, bool flush_cache, const std::optional<std::string>& label,
    bool finished, bool abort_all) {
  if (!failure().empty()) throw unavailable("the engine failed: " + failure());
  auto [n, v] = call([&]() -> std::pair<size_t, uint64_t> {
    engine_->stage_weights(std::move(tensors));
    const size_t staged = engine_->staged_weight_tensors();
    if (!finished) return {staged, engine_->weight_version()};
    if (abort_all) abort_targets();
    engine_->commit_staged_weights(flush_cache);
    kick_ = true;
    weight_version_ = engine_->weight_version();
    return {staged, engine_->weight_version()};
  });
  if (finished) set_weight_label(label ? *label : std::to_string(v));
  return {n, v};
}

std::string EngineLoop::weight_label() const {
  std::lock_guard<std::mutex> lk(mu_);
  return weight_label_;
}

void EngineLoop::set_weight_label(const std::string& label) {
  std::lock_guard<std::mutex> lk(mu_);
  weight_label_ = label;
}

void EngineLoop::pause_generation(const std::string& mode) {
  if (mode != "abort" && mode != "in_place" && mode != "retract")
    throw bad_call("\"mode\" must be \"abort\", \"in_place\" or \"retract\", got \"" + mode + "\"",
                   "mode");
  call([&] {
    paused_ = true;
    if (mode == "retract") engine_->retract_all();
    if (mode == "abort") {
      abort_targets();
      // Deliver the aborts now, without running the model.
      std::vector<RequestOutput> outs = engine_->apply_aborts();
      deliver(outs);
    }
  });
}

void EngineLoop::continue_generation() {
  call([&] { paused_ = false; });
}

bool EngineLoop::flush_cache() {
  return call([&] { return engine_->reset_prefix_cache(); });
}

void EngineLoop::release_memory(bool kv_cache, bool weights) {
  call([&] { engine_->release_memory(kv_cache, weights); });
}

void EngineLoop::resume_memory(bool kv_cache, bool weights) {
  call([&] { engine_->resume_memory(kv_cache, weights); });
}

double EngineLoop::seconds_in_step() const {
  const int64_t t0 = step_started_ns_.load();
  if (t0 == 0) return 0.0;
  return double(std::chrono::steady_clock::now().time_since_epoch().count() - t0) * 1e-9;
}

size_t EngineLoop::drain(std::chrono::milliseconds grace) {
  try {
    call([&] { draining_ = true; });
  } catch (const ServingError&) {
    return 0;  // already shut down
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  auto in_flight = [&] {
    try {
      return call([&] { return targets_.size(); });
    } catch (const ServingError&) {
      return size_t(0);
    }
  };
  while (in_flight() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  size_t aborted = 0;
  try {
    aborted = abort_all();
  } catch (const ServingError&) {
  }
  // Let the aborts reach their callers (each gets its "abort" reply) before the loop ends.
  const auto abort_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (in_flight() > 0 && std::chrono::steady_clock::now() < abort_deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return aborted;
}

LoopStats EngineLoop::stats() {
  LoopStats s = call([&]() -> LoopStats {
    LoopStats s;
    s.engine = engine_->stats();
    s.step_latency = latency_;
    s.in_flight = targets_.size();
    s.paused = paused_;
    return s;
  });
  s.weight_label = weight_label();
  return s;
}

void EngineLoop::forget(uint64_t id) {
  auto it = targets_.find(id);
  if (it == targets_.end()) return;
  auto r = rids_.find(it->second.rid);
  if (r != rids_.end()) {
    auto& v = r->second;
    v.erase(std::remove(v.begin(), v.end(), id), v.end());
    if (v.empty()) rids_.erase(r);
  }
  targets_.erase(it);
}

void EngineLoop::fail_all(const std::string& why) {
  for (auto& [id, t] : targets_) t.ch->fail(why);
  targets_.clear();
  rids_.clear();
}

void EngineLoop::step_once() {
  const auto t0 = std::chrono::steady_clock::now();
  step_started_ns_ = t0.time_since_epoch().count();
  struct Clear {
    std::atomic<int64_t>& v;
    ~Clear() { v = 0; }
  } clear{step_started_ns_};
  std::vector<RequestOutput> outs = engine_->step();
  latency_.add(seconds_since(t0));
  deliver(outs);
}

void EngineLoop::deliver(std::vector<RequestOutput>& outs) {
  for (auto& o : outs) {
    auto it = targets_.find(o.request_id);
    if (it == targets_.end()) continue;
    const bool fin = o.finished;
    it->second.ch->publish(it->second.choice, std::move(o));
    if (fin) forget(it->first);
  }
}

void EngineLoop::run() {
  bool busy = false;
  for (;;) {
    std::deque<std::function<void()>> cmds;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !commands_.empty() || busy; });
      if (stop_) break;
      cmds.swap(commands_);
    }
    for (auto& c : cmds) c();  // exceptions stay inside each packaged task
    try {
      // Paused or released: no step runs, but aborts still reach their callers.
      if (failure().empty() && (paused_ || released_)) {
        std::vector<RequestOutput> outs = engine_->apply_aborts();
        deliver(outs);
      }
      if (failure().empty() && !paused_ && !released_ && (engine_->has_unfinished() || kick_)) {
        kick_ = false;
        step_once();
      }
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        failure_ = e.what();
      }
      fail_all(std::string("the engine failed: ") + e.what());
    }
    busy = failure().empty() && !paused_ && !released_ && (engine_->has_unfinished() || kick_);
  }
  // Shutdown: answer every pending command and call.
  std::deque<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lk(mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
  fail_all("server shutting down");
}

}  // namespace r3::serving
