#include "bench_run.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/rng.h"

namespace r3::cli {

double flops_per_token(const ModelConfig& c, double avg_ctx) {
  const double H = c.hidden_size, qd = double(c.num_heads) * c.head_dim,
               kvd = double(c.num_kv_heads) * c.head_dim;
  double f = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.mla) {
      // MLA, absorbed: q (through the low-rank path), the latent, uk_t and uv per head, o; then
      // scores over the latent row and the latent-space weighted sum per head.
      const MlaSpec& m = *c.mla;
      const double nh = c.num_heads, qw = nh * m.qk_head_dim();
      f += 2 * (m.q_lora_rank ? H * m.q_lora_rank + m.q_lora_rank * qw : H * qw);
      f += 2 * (H * m.latent_width() + nh * m.qk_nope_head_dim * m.kv_lora_rank +
                nh * m.v_head_dim * m.kv_lora_rank + nh * m.v_head_dim * H);
      f += 2 * avg_ctx * nh * (m.latent_width() + m.kv_lora_rank);
    } else if (c.layers[size_t(l)].attention.kind == AttentionKind::GatedDeltaNet) {
      // Projections (q k v, z, b, a; out), then per value head the decay, S^T k, the rank-1
      // update and S^T q: four passes over its dk x dv state, a multiply-add each.
      const DeltaNetSpec& d = *c.deltanet;
      f += 2 * (H * (d.conv_dim() + d.value_dim() + 2.0 * d.v_heads) + double(d.value_dim()) * H);
      f += 2 * 4.0 * d.v_heads * d.k_head_dim * d.v_head_dim;
    } else {
      const AttentionSpec& a = c.layers[size_t(l)].attention;
      const int window = a.sliding_window;
      f += 2 * (H * qd * (a.output_gate ? 3 : 2) + H * kvd * 2);  // q (and its gate), o; k, v
      f += 2 * 2 * (window > 0 ? std::min(avg_ctx, double(window)) : avg_ctx) * qd;
    }
    const LayerConfig& lc = c.layers[size_t(l)];
    if (lc.moe)
      f += 2 * (H * c.num_experts + c.top_k * 3.0 * H * c.moe_intermediate_size +
                3.0 * H * lc.shared_intermediate);
    else
      f += 2 * 3.0 * H * c.intermediate_size;
  }
  return f;
}

double kv_bytes_per_token(const ModelConfig& c, double ctx, double element_bytes) {
  double b = 0;
  for (const LayerConfig& l : c.layers) {
    if (l.attention.kind == AttentionKind::GatedDeltaNet) continue;  // a recurrent state, no KV
    const int w = l.attention.sliding_window;
    b += double(c.kv_cache_width()) * (w > 0 ? std::min(ctx, double(w)) : ctx) * element_bytes;
  }
  return b;
}

int64_t kv_tokens_needed(const Entry& en, bool prefix_caching, int block_size) {
  const int64_t shared = prefix_caching ? std::min(en.shared_prefix, en.prompt_len) : 0;
  const int64_t bases = shared > 0 ? std::min(kPrefixBases, en.requests) : 0;
  return bases * shared +
         int64_t(en.requests) * (en.prompt_len - shared + en.max_tokens + block_size);
}

TimedRun::TimedRun(Engine& e, const Entry& en, bool ask_routes, uint64_t run)
    : e_(e), en_(en), timing_started_(en.measure != Entry::Decode) {
  if (en.measure == Entry::Decode) run = 0;
  const int vocab = e.model_config().vocab_size;
  auto token = [&](uint64_t stream, size_t i) {
    return 3 + int(hash_pair(hash_pair(run, stream), i) % uint64_t(vocab - 3));
  };
  std::vector<std::vector<int>> bases(kPrefixBases);
  for (size_t b = 0; b < bases.size(); ++b)
    for (int i = 0; i < en.shared_prefix; ++i) bases[b].push_back(token(b, size_t(i)));
  std::vector<std::vector<int>> prompts;
  for (int r = 0; r < en.requests; ++r) {
    std::vector<int> p = en.shared_prefix ? bases[size_t(r) % bases.size()] : std::vector<int>{};
    while (int(p.size()) < en.prompt_len)
      p.push_back(token(1000 + uint64_t(r), en.copyable ? p.size() % 32 : p.size()));
    prompts.push_back(p);
  }
  SamplingParams sp;
  sp.temperature = en.copyable ? 0.f : 1.f;
  sp.ignore_eos = true;
  sp.return_routed_experts = ask_routes;
  // Untimed, one token each: what the timed run should find in the prefix cache.
  auto run_untimed = [&](const std::vector<std::vector<int>>& cached) {
    sp.max_tokens = 1;
    for (const std::vector<int>& p : cached) e.add_request(p, sp);
    while (e.has_unfinished()) e.step();
  };
  // Decode: the prompts, so the timed run starts every request at once (a cache hit, not a
  // chunked prefill that lets the first requests finish before the last begins) and measures
  // decode at the full context.
  if (en.measure == Entry::Decode) run_untimed(prompts);
  // A shared-prefix prefill: the prefixes alone, so the timed prefill starts from a prefix hit
  // (a hybrid's restores the recurrent-state snapshot taken at its end).
  if (en.measure == Entry::Prefill && en.shared_prefix > 0)
    run_untimed(
        {bases.begin(), bases.begin() + std::min<ptrdiff_t>(ptrdiff_t(bases.size()), en.requests)});
  sp.max_tokens = en.max_tokens;
  for (int r = 0; r < en.requests; ++r) {
    sp.seed = uint64_t(r);
    e.add_request(prompts[size_t(r)], sp);
  }
  before_ = start_ = e.stats();
}

bool TimedRun::step() {
  if (!e_.has_unfinished()) return false;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  e_.step();
  const double dt = std::chrono::duration<double>(clock::now() - t0).count();
  if (timing_started_) {
    seconds_ += dt;
  } else if (e_.stats().generated_tokens - start_.generated_tokens >= uint64_t(en_.requests)) {
    // The first step(s) prefill; decode timing starts once every request has its first token.
    timing_started_ = true;
    start_ = e_.stats();
  }
  return e_.has_unfinished();
}

Timing TimedRun::timing() const {
  const EngineStats s = e_.stats();
  const double secs = seconds_;
  const double tokens = en_.measure == Entry::Decode
                            ? double(s.generated_tokens - start_.generated_tokens)
                            : double(s.computed_tokens - start_.computed_tokens);
  Timing t;
  t.preemptions = s.preemptions - before_.preemptions;
  if (!(secs > 0)) return t;  // nothing timed (a decode entry of one token)
  t.tokens_per_s = tokens / secs;
  t.seconds = secs;
  t.weight_gb_per_s = double(s.weight_bytes_read - start_.weight_bytes_read) / secs / 1e9;
  t.route_fraction = (s.route_seconds - start_.route_seconds) / secs;
  t.deltanet_fraction = (s.deltanet_seconds - start_.deltanet_seconds) / secs;
  const double avg_ctx =
      en_.measure == Entry::Prefill ? en_.prompt_len / 2.0 : en_.prompt_len + en_.max_tokens / 2.0;
  t.gflops = tokens * flops_per_token(e_.model_config(), avg_ctx) / secs / 1e9;
  // KV bytes read per second over the whole timed span (a lower bound on attention's own rate),
  // and over the time the engine spent in attention over the cache
  // (EngineStats::attention_seconds).
  const double kv_element = s.kv_cache_dtype == "bf16" ? 2.0 : 4.0;
  const double kv_bytes = tokens * kv_bytes_per_token(e_.model_config(), avg_ctx, kv_element);
  t.kv_gb_per_s = kv_bytes / secs / 1e9;
  const double attention_secs = s.attention_seconds - start_.attention_seconds;
  t.attention_kv_gb_per_s = attention_secs > 0 ? kv_bytes / attention_secs / 1e9 : 0;
  return t;
}

Timing run_entry(Engine& e, const Entry& en, bool ask_routes, uint64_t run) {
  TimedRun r(e, en, ask_routes, run);
  while (r.step()) {
  }
  return r.timing();
}

std::pair<Timing, Timing> run_entries_paired(Engine& a, bool a_asks_routes, Engine& b,
                                             bool b_asks_routes, const Entry& en, uint64_t run) {
  TimedRun ra(a, en, a_asks_routes, run), rb(b, en, b_asks_routes, run);
  for (bool a_left = true, b_left = true; a_left || b_left;) {
    if (a_left) a_left = ra.step();
    if (b_left) b_left = rb.step();
  }
  return {ra.timing(), rb.timing()};
}

}  // namespace r3::cli
