#include "server/metrics.h"

#include <cstdio>
#include <sstream>

namespace r3::server {

namespace {

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string escape_label(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

class Writer {
 public:
  void metric(const std::string& name, const char* type, const std::string& help) {
    os_ << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  }
  void sample(const std::string& name, double v, const std::string& labels = "") {
    os_ << name;
    if (!labels.empty()) os_ << "{" << labels << "}";
    os_ << " " << num(v) << "\n";
  }
  void one(const std::string& name, const char* type, const std::string& help, double v) {
    metric(name, type, help);
    sample(name, v);
  }
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
};

}  // namespace

std::string prometheus_text(const LoopStats& s, const HttpCounters& http,
                            const std::string& model_name) {
  const EngineStats& e = s.engine;
  Writer w;
  w.metric("r3_model_info", "gauge", "the served model (value 1)");
  w.sample("r3_model_info", 1, "model=\"" + escape_label(model_name) + "\"");
  w.one("r3_requests_finished_total", "counter", "requests that finished (stop or length)",
        double(e.requests_finished));
  w.one("r3_requests_aborted_total", "counter",
        "requests aborted (by /abort or a disconnected client)", double(e.requests_aborted));
  w.one("r3_requests_running", "gauge", "requests the scheduler is running", e.running);
  w.one("r3_requests_waiting", "gauge", "requests waiting for admission", e.waiting);
  w.one("r3_requests_in_flight", "gauge", "engine requests an HTTP call is waiting on",
        double(s.in_flight));
  w.one("r3_prompt_tokens_total", "counter", "prompt tokens of admitted requests",
        double(e.prompt_tokens));
  w.one("r3_generation_tokens_total", "counter", "tokens sampled", double(e.generated_tokens));
  w.one("r3_computed_tokens_total", "counter", "tokens run through the model (prefill + decode)",
        double(e.computed_tokens));
  w.one("r3_padded_tokens_total", "counter", "padding tokens of bucketed decode steps",
        double(e.padded_tokens));
  w.one("r3_steps_total", "counter", "engine steps", double(e.steps));
  w.one("r3_chunked_prefills_total", "counter", "prefills split over several steps",
        double(e.chunked_prefills));
  w.one("r3_preemptions_total", "counter", "requests preempted for KV space",
        double(e.preemptions));
  w.one("r3_prefix_cache_hit_tokens_total", "counter", "prompt tokens served from the prefix cache",
        double(e.prefix_hit_tokens));
  w.one("r3_prefix_cache_queried_tokens_total", "counter",
        "prompt tokens looked up in the prefix cache", double(e.prefix_queried_tokens));
  w.one("r3_prefix_cache_hit_rate", "gauge", "hit tokens / queried tokens since start",
        e.prefix_queried_tokens ? double(e.prefix_hit_tokens) / double(e.prefix_queried_tokens)
                                : 0.0);
  // Speculative decoding (vLLM's spec_decode_* names, as r3 counters).
  w.one("r3_spec_decode_num_draft_tokens_total", "counter", "drafted tokens verified",
        double(e.spec_draft_tokens));
  w.one("r3_spec_decode_num_accepted_tokens_total", "counter",
        "drafted tokens accepted (equal to the token sampled at their position)",
        double(e.spec_accepted_tokens));
  w.one("r3_spec_decode_acceptance_rate", "gauge", "accepted / drafted tokens since start",
        e.spec_draft_tokens ? double(e.spec_accepted_tokens) / double(e.spec_draft_tokens) : 0.0);
  w.one("r3_spec_decode_steps_off_total", "counter",
        "steps that drafted nothing: more requests decoding than speculative_disable_by_batch_size",
        double(e.spec_steps_off));
  w.metric("r3_cache_config_info", "gauge", "the KV cache configuration (value 1)");
  w.sample("r3_cache_config_info", 1,
           "block_size=\"" + std::to_string(e.block_size) + "\",cache_dtype=\"" +
               escape_label(e.kv_cache_dtype) + "\"");
  w.metric("r3_weight_version_info", "gauge", "the weight version label (value 1)");
  w.sample("r3_weight_version_info", 1, "weight_version=\"" + escape_label(s.weight_label) + "\"");
  w.one("r3_generation_paused", "gauge", "1 while pause_generation holds the engine",
        s.paused ? 1 : 0);
  w.one("r3_kv_blocks_total", "gauge", "KV blocks in the pool", e.num_blocks);
  w.one("r3_kv_blocks_free", "gauge", "free KV blocks", e.free_blocks);
  w.one("r3_kv_cache_usage_ratio", "gauge", "fraction of KV blocks in use",
        e.num_blocks ? 1.0 - double(e.free_blocks) / double(e.num_blocks) : 0.0);
  w.one("r3_kv_window_blocks_total", "gauge",
        "KV blocks in the sliding-window layers' pool (0: none)", e.num_window_blocks);
  w.one("r3_kv_window_blocks_free", "gauge", "free blocks of the sliding-window layers' pool",
        e.free_window_blocks);
  w.one("r3_kv_window_blocks_freed_total", "counter",
        "sliding-window blocks released as windows slid past", double(e.window_blocks_freed));
  w.one("r3_recurrent_state_bytes_per_request", "gauge",
        "hybrids: bytes of one running request's DeltaNet state",
        double(e.recurrent_state_bytes_per_request));
  w.one("r3_state_snapshots_total", "gauge", "hybrids: recurrent-state snapshot slots (0: none)",
        e.state_snapshots);
  w.one("r3_state_snapshots_held", "gauge", "hybrids: snapshots a prefix hit can restore",
        e.state_snapshots_held);
  w.one("r3_state_snapshot_bytes", "gauge",
        "hybrids: bytes of the snapshot slots (committed as written)",
        double(e.state_snapshot_bytes));
  w.one("r3_state_snapshot_restores_total", "counter",
        "hybrids: prefix hits that restored a snapshot", double(e.state_snapshot_restores));
  w.one("r3_state_snapshot_cut_tokens_total", "counter",
        "hybrids: cached prefix tokens recomputed because no snapshot ended there",
        double(e.state_snapshot_cut_tokens));
  w.one("r3_weight_version", "gauge", "weight version (increases with every refit)",
        double(e.weight_version));
  w.one("r3_weight_bytes_read_total", "counter", "checkpoint bytes read",
        double(e.weight_bytes_read));
  w.one("r3_route_bytes_returned_total", "counter", "bytes of routed_experts returned to clients",
        double(e.route_bytes_returned));
  w.one("r3_route_rows_committed_total", "counter", "route rows committed by the route manager",
        double(e.route_rows_committed));
  w.one("r3_prefix_route_rows_copied_total", "counter",
        "route rows copied from the shared route cache", double(e.prefix_route_rows_copied));
  w.one("r3_stale_prefix_route_rows_total", "counter", "shared route cache rows refused as stale",
        double(e.stale_prefix_rows));
  w.one("r3_capture_ring_waits_total", "counter", "forwards that waited for a free capture slot",
        double(e.capture_waits));
  w.one("r3_routed_experts_gaps_total", "counter", "route rows missing at assembly (must stay 0)",
        double(e.routed_experts_gaps));

  w.metric("r3_step_latency_seconds", "histogram", "wall time of one engine step");
  uint64_t cum = 0;
  for (size_t i = 0; i < std::size(StepLatency::kBounds); ++i) {
    cum += s.step_latency.buckets[i];
    w.sample("r3_step_latency_seconds_bucket", double(cum),
             "le=\"" + num(StepLatency::kBounds[i]) + "\"");
  }
  w.sample("r3_step_latency_seconds_bucket", double(s.step_latency.count), "le=\"+Inf\"");
  w.sample("r3_step_latency_seconds_sum", s.step_latency.sum);
  w.sample("r3_step_latency_seconds_count", double(s.step_latency.count));

  w.metric("r3_expert_load_tokens_total", "counter",
           "tokens routed to each logical expert, per MoE layer");
  for (size_t l = 0; l < e.expert_load.size(); ++l) {
    const int layer = l < e.moe_layers.size() ? e.moe_layers[l] : int(l);
    for (size_t x = 0; x < e.expert_load[l].size(); ++x)
      w.sample("r3_expert_load_tokens_total", double(e.expert_load[l][x]),
               "layer=\"" + std::to_string(layer) + "\",expert=\"" + std::to_string(x) + "\"");
  }

  w.metric("r3_http_responses_total", "counter", "HTTP responses by endpoint and status");
  for (const auto& [k, v] : http.responses)
    w.sample(
        "r3_http_responses_total", double(v),
        "endpoint=\"" + escape_label(k.first) + "\",code=\"" + std::to_string(k.second) + "\"");
  return w.str();
}

}  // namespace r3::server
