#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/exp.h"
#include "kernels/ops.h"

namespace r3 {

void SamplingParams::validate(int vocab_size) const {
  if (max_tokens < 0) throw FieldError("max_tokens", "max_tokens must be >= 0");
  if (!(temperature >= 0.f) || !std::isfinite(temperature))
    throw FieldError("temperature", "temperature must be >= 0");
  if (!(top_p > 0.f && top_p <= 1.f)) throw FieldError("top_p", "top_p must be in (0, 1]");
  if (top_k < -1) throw FieldError("top_k", "top_k must be -1, 0 (off) or positive");
  for (int t : stop_token_ids)
    if (t < 0 || t >= vocab_size)
      throw FieldError("stop_token_ids", "stop_token_ids holds " + std::to_string(t) +
                                             ", outside the vocabulary [0, " +
                                             std::to_string(vocab_size) + ")");
  if (stop.size() > kMaxStopStrings)
    throw FieldError("stop", "stop holds " + std::to_string(stop.size()) + " strings; at most " +
                                 std::to_string(kMaxStopStrings));
  for (const std::string& s : stop)
    if (s.empty() || s.size() > kMaxStopStringBytes)
      throw FieldError("stop", "stop strings must be 1 to " + std::to_string(kMaxStopStringBytes) +
                                   " bytes long");
  if (routed_experts_start < 0)
    throw FieldError("routed_experts_start", "routed_experts_start must be >= 0");
  if (return_routed_expert_weights && !return_routed_experts)
    throw FieldError("return_routed_expert_weights",
                     "return_routed_expert_weights needs return_routed_experts");
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs)
    throw FieldError("top_logprobs",
                     "top_logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
  if (prompt_logprobs_start < -1)
    throw FieldError("prompt_logprobs_start", "prompt_logprobs_start must be -1 (none) or >= 0");
}

LogitStats logit_stats(const float* logits, int V, std::vector<float>& scratch) {
  // Numerators exp(l - max) (exp.h), summed in double in a fixed order.
  LogitStats s;
  s.max = logits[0];
  bool nan = std::isnan(logits[0]);
  for (int i = 1; i < V; ++i) {
    if (logits[i] > s.max) s.max = logits[i], s.argmax = i;
    nan |= std::isnan(logits[i]);  // a NaN loses every comparison: it must be looked for
  }
  scratch.resize(size_t(V));
  kernels::exp_below_max(logits, V, s.max, 1.f, scratch.data());
  s.z = kernels::sum_f64(scratch.data(), V);
  s.log_z = nan ? std::numeric_limits<float>::quiet_NaN() : float(std::log(s.z)) + s.max;
  return s;
}

void top_logprobs(const float* logits, int V, float log_z, int k, TopLogprobs& out) {
  k = std::min({k, V, kMaxTopLogprobs});
  out.n = 0;
  // Insertion into a sorted list of at most k: one pass over the vocabulary.
  for (int t = 0; t < V; ++t) {
    const float l = logits[t];
    if (out.n == k && !(l > logits[out.ids[k - 1]])) continue;  // ties keep the lower id
    int at = out.n < k ? out.n++ : k - 1;
    while (at > 0 && l > logits[out.ids[at - 1]]) {
      out.ids[at] = out.ids[at - 1];
      --at;
    }
    out.ids[at] = t;
  }
  for (int i = 0; i < out.n; ++i) out.logprobs[i] = logits[out.ids[i]] - log_z;
}

namespace {

Sample draw(const float* logits, int V, const SamplerParams& p, int position,
            std::vector<float>& scratch, std::vector<int>& order, float& log_z_out);

}  // namespace

Sample sample_token(const float* logits, int V, const SamplerParams& p, int position,
                    std::vector<float>& scratch, std::vector<int>& order) {
  float log_z = 0.f;
  Sample s = draw(logits, V, p, position, scratch, order, log_z);
  if (!s.nonfinite && p.top_logprobs > 0) top_logprobs(logits, V, log_z, p.top_logprobs, s.top);
  return s;
}

namespace {

Sample draw(const float* logits, int V, const SamplerParams& p, int position,
            std::vector<float>& scratch, std::vector<int>& order, float& log_z_out) {
  // The reported logprob is the log-softmax of the raw logits.
  const LogitStats st = logit_stats(logits, V, scratch);
  const int argmax = st.argmax;
  const float m = st.max, log_z = st.log_z;
  const double z = st.z;
  log_z_out = log_z;
  // A NaN or infinite logit makes z or m non-finite: fail closed rather than sample from it.
  if (!std::isfinite(log_z)) return {0, 0.f, true, {}};
  if (p.temperature == 0.f) return {argmax, logits[argmax] - log_z, false, {}};

  // Candidates: all ids in id order (plain sampling needs no sort), or, with top_k / top_p, the
  // best ones by descending logit with ties to the lower id. Either is a fixed order, so the
  // draw is reproducible. scratch[i] becomes candidate i's weight exp((l - max) / temperature).
  auto by_logit = [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int keep = V;
  const bool sorted = (p.top_k > 0 && p.top_k < V) || p.top_p < 1.f;
  double total = z;
  if (!sorted) {
    if (p.temperature != 1.f) {
      kernels::exp_below_max(logits, V, m, p.temperature, scratch.data());
      total = kernels::sum_f64(scratch.data(), V);
    }
  } else {
    order.resize(size_t(V));
    std::iota(order.begin(), order.end(), 0);
    if (p.top_k > 0 && p.top_k < V) {
      keep = p.top_k;
      std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_logit);
    } else {
      std::sort(order.begin(), order.end(), by_logit);
    }
    total = 0.0;
    for (int i = 0; i < keep; ++i) {
      scratch[size_t(i)] = kernels::exp_nonpositive((logits[order[size_t(i)]] - m) / p.temperature);
      total += scratch[size_t(i)];
    }
  }
  if (p.top_p < 1.f) {
    double cum = 0.0;
    int n = 0;
    while (n < keep) {
      cum += scratch[size_t(n)] / total;
      ++n;
      if (cum >= p.top_p) break;
    }
    keep = n;
    total = 0.0;
    for (int i = 0; i < keep; ++i) total += scratch[size_t(i)];
  }
  const double u = uniform01(p.seed, uint64_t(position)) * total;
  double cum = 0.0;
  auto id_of = [&](int i) { return sorted ? order[size_t(i)] : i; };
  int pick = id_of(keep - 1);
  for (int i = 0; i < keep; ++i) {
    cum += scratch[size_t(i)];
    if (u < cum) {
      pick = id_of(i);
      break;
    }
  }
  return {pick, logits[pick] - log_z, false, {}};
}

}  // namespace

}  // namespace r3
