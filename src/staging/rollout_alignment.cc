// r3 align, library half: engine rollouts with routes -> staging -> trainer forward without and
// with replay -> alignment metrics. See rollout_alignment.h for what is scored and why.
#include "staging/rollout_alignment.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <istream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/rng.h"
#include "reference/reference_forward.h"

namespace r3 {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Input
// ---------------------------------------------------------------------------------------------

namespace {

std::vector<int> token_list(const json& j, const std::string& what) {
  if (!j.is_array()) throw Error(what + " must be an array of token ids");
  std::vector<int> out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const json& v = j[i];
    if (!v.is_number_integer())
      throw Error(what + "[" + std::to_string(i) + "] is not an integer token id");
    const int64_t x = v.get<int64_t>();
    if (x < 0 || x > std::numeric_limits<int>::max())
      throw Error(what + "[" + std::to_string(i) + "] = " + std::to_string(x) +
                  " is not a valid token id");
    out.push_back(int(x));
  }
  return out;
}

}  // namespace

RolloutSpec rollout_from_json(const json& j) {
  if (!j.is_object()) throw Error("a rollout line must be a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it)
    if (it.key() != "prompt_token_ids" && it.key() != "turns")
      throw Error("unknown key \"" + it.key() + "\" (expected prompt_token_ids and turns)");
  if (!j.contains("prompt_token_ids")) throw Error("missing \"prompt_token_ids\"");
  RolloutSpec r;
  r.prompt = token_list(j["prompt_token_ids"], "prompt_token_ids");
  if (r.prompt.empty()) throw Error("prompt_token_ids is empty");
  if (j.contains("turns") && !j["turns"].is_null()) {
    const json& t = j["turns"];
    if (!t.is_array()) throw Error("\"turns\" must be an array of arrays of token ids");
    for (size_t i = 0; i < t.size(); ++i) {
      r.turns.push_back(token_list(t[i], "turns[" + std::to_string(i) + "]"));
      if (r.turns.back().empty())
        throw Error("turns[" + std::to_string(i) + "] is empty (a turn must add user tokens)");
    }
  }
  return r;
}

std::vector<RolloutSpec> read_rollouts_jsonl(std::istream& in, const std::string& name) {
  std::vector<RolloutSpec> out;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      out.push_back(rollout_from_json(json::parse(line)));
    } catch (const json::exception& e) {
      throw Error(name + ":" + std::to_string(lineno) + ": malformed JSON: " + e.what());
    } catch (const Error& e) {
      throw Error(name + ":" + std::to_string(lineno) + ": " + e.what());
    }
  }
  return out;
}

std::vector<RolloutSpec> random_rollouts(const RandomRolloutOptions& o, int vocab, int bos_id,
                                         int eos_id) {
  if (o.num_rollouts < 0) throw Error("random_rollouts: num_rollouts must be >= 0");
  if (o.turns < 1) throw Error("random_rollouts: turns must be >= 1");
  if (o.min_prompt < 1 || o.max_prompt < o.min_prompt || o.min_user < 1 || o.max_user < o.min_user)
    throw Error("random_rollouts: lengths must satisfy 1 <= min <= max");
  const int specials =
      (bos_id >= 0 && bos_id < vocab) + (eos_id >= 0 && eos_id < vocab && eos_id != bos_id);
  if (vocab - specials < 1) throw Error("random_rollouts: vocabulary has no ordinary tokens");
  // Counter-based draws: portable and independent of call order.
  uint64_t counter = 0;
  const uint64_t key = hash_pair(o.seed, 0x726f6c6c6f757473ull);  // "rollouts"
  auto draw = [&](uint64_t n) { return hash_pair(key, counter++) % n; };
  auto len = [&](int lo, int hi) { return lo + int(draw(uint64_t(hi - lo + 1))); };
  auto token = [&]() {
    for (;;) {
      const int t = int(draw(uint64_t(vocab)));
      if (t != bos_id && t != eos_id) return t;
    }
  };
  std::vector<RolloutSpec> out(size_t(o.num_rollouts));
  for (auto& r : out) {
    r.prompt.resize(size_t(len(o.min_prompt, o.max_prompt)));
    for (auto& t : r.prompt) t = token();
    for (int turn = 1; turn < o.turns; ++turn) {
      std::vector<int> u(size_t(len(o.min_user, o.max_user)));
      for (auto& t : u) t = token();
      r.turns.push_back(std::move(u));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

namespace {

bool row_valid(const RouteArray& r, int row) {
  const int16_t* p = r.row(row);
  for (size_t i = 0; i < size_t(r.layers) * size_t(r.k); ++i)
    if (p[i] < 0) return false;
  return true;
}

bool rows_equal(const RouteArray& a, int ra, const RouteArray& b, int rb) {
  return std::memcmp(a.row(ra), b.row(rb), size_t(a.layers) * size_t(a.k) * sizeof(int16_t)) == 0;
}

// Which rows of the assembled rollout hold a real engine route: not -1 anywhere, and not a
// filler row (the last token of a call, unless boundary repair put the next call's real route
// there).
std::vector<bool> real_route_mask(const RolloutTrace& t, bool repaired) {
  const int S = int(t.tokens.size());
  std::vector<bool> real(size_t(S), false);
  for (int p = 0; p < S; ++p) real[size_t(p)] = row_valid(t.routes, p);
  for (size_t i = 0; i < t.call_lens.size(); ++i) {
    const int p = t.call_lens[i] - 1;
    if (p < 0 || p >= S || !real[size_t(p)]) continue;
    bool ok = false;
    if (repaired && i + 1 < t.engine_replies.size()) {
      const RouteArray& next = t.engine_replies[i + 1];
      if (next.layers == t.routes.layers && next.k == t.routes.k && p >= next.start &&
          p < next.start + next.rows && row_valid(next, p - next.start))
        ok = rows_equal(t.routes, p, next, p - next.start);
    }
    real[size_t(p)] = ok;
  }
  return real;
}

std::string rollout_name(int i, int turn) {
  return "rollout " + std::to_string(i) + ", turn " + std::to_string(turn + 1);
}

}  // namespace

RolloutAlignmentResult run_rollout_alignment(Engine& engine, const ModelWeights& trainer,
                                             const std::vector<RolloutSpec>& rollouts,
                                             const RolloutAlignmentOptions& opt) {
  const ModelConfig& mc = engine.model_config();
  const int L = mc.num_moe_layers(), K = mc.top_k, E = mc.num_experts;
  if (!engine.config().enable_return_routed_experts)
    throw Error("r3 align: the engine must be started with enable_return_routed_experts");
  if (trainer.config.vocab_size != mc.vocab_size || trainer.config.num_moe_layers() != L ||
      trainer.config.top_k != K || trainer.config.num_experts != E)
    throw Error(
        "r3 align: the trainer weights are not the engine's model (vocab, MoE layers, "
        "top-k or experts differ)");
  if (opt.max_tokens < 1) throw Error("r3 align: max_tokens must be >= 1");
  if (L < 1) throw Error("r3 align: the model has no MoE layers");

  const int n = int(rollouts.size());
  std::vector<RolloutTrace> tr(static_cast<size_t>(n));
  std::vector<std::vector<StagedCall>> staged(static_cast<size_t>(n));
  int max_turns = 0;
  for (int i = 0; i < n; ++i) {
    if (rollouts[size_t(i)].prompt.empty())
      throw Error(rollout_name(i, 0) + ": the prompt is empty");
    tr[size_t(i)].index = i;
    tr[size_t(i)].tokens = rollouts[size_t(i)].prompt;
    tr[size_t(i)].generated.assign(tr[size_t(i)].tokens.size(), false);
    tr[size_t(i)].engine_logprobs.assign(tr[size_t(i)].tokens.size(), std::nanf(""));
    max_turns = std::max(max_turns, rollouts[size_t(i)].num_turns());
  }

  // ---- engine: turn t of every live rollout in one run -----------------------------------
  for (int t = 0; t < max_turns; ++t) {
    std::map<uint64_t, int> rollout_of;
    std::map<int, int> prev_len_of;
    for (int i = 0; i < n; ++i) {
      RolloutTrace& x = tr[size_t(i)];
      if (x.dropped || rollouts[size_t(i)].num_turns() <= t) continue;
      const int prev_len = t == 0 ? 0 : int(x.tokens.size());
      if (t > 0) {
        const auto& user = rollouts[size_t(i)].turns[size_t(t - 1)];
        x.tokens.insert(x.tokens.end(), user.begin(), user.end());
        x.generated.resize(x.tokens.size(), false);
        x.engine_logprobs.resize(x.tokens.size(), std::nanf(""));
      }
      SamplingParams sp;
      sp.max_tokens = opt.max_tokens;
      sp.temperature = opt.temperature;
      sp.top_p = opt.top_p;
      sp.top_k = opt.top_k;
      sp.ignore_eos = opt.ignore_eos;
      sp.seed = hash_pair(hash_pair(opt.seed, uint64_t(i)), uint64_t(t));
      sp.logprobs = true;
      sp.return_routed_experts = true;
      // Turns after the first ask from prev_len - 1: that row is the previous call's last
      // token, routed for real only now (boundary repair reads it).
      sp.routed_experts_start = t == 0 ? 0 : prev_len - 1;
      uint64_t id = 0;
      try {
        id = engine.add_request(x.tokens, sp);
      } catch (const Error& e) {
        throw Error(rollout_name(i, t) + ": " + e.what());
      }
      rollout_of[id] = i;
      prev_len_of[i] = prev_len;
    }
    if (rollout_of.empty()) break;

    std::map<int, RequestOutput> done;
    int idle = 0;
    while (done.size() < rollout_of.size()) {
      auto outs = engine.step();
      for (auto& o : outs) {
        auto it = rollout_of.find(o.request_id);
        if (o.finished && it != rollout_of.end()) done[it->second] = std::move(o);
      }
      idle = (outs.empty() && !engine.has_unfinished()) ? idle + 1 : 0;
      if (idle > 8)
        throw Error("r3 align: the engine stopped with " +
                    std::to_string(rollout_of.size() - done.size()) + " requests of turn " +
                    std::to_string(t + 1) + " unfinished");
    }

    for (auto& [i, o] : done) {
      RolloutTrace& x = tr[size_t(i)];
      const int prev_len = prev_len_of.at(i);
      for (size_t g = 0; g < o.token_ids.size(); ++g) {
        x.tokens.push_back(o.token_ids[g]);
        x.generated.push_back(true);
        x.engine_logprobs.push_back(g < o.logprobs.size() ? o.logprobs[g] : std::nanf(""));
      }
      if (o.logprobs.size() != o.token_ids.size()) {
        x.dropped = true;
        x.warning = rollout_name(i, t) + ": the engine returned " +
                    std::to_string(o.logprobs.size()) + " logprobs for " +
                    std::to_string(o.token_ids.size()) + " tokens";
        continue;
      }
      const int T = int(x.tokens.size());
      x.call_lens.push_back(T);
      RouteArray reply;  // empty reply: lenient staging turns it into -1 rows
      std::string missing;
      if (!o.routes_error.empty())
        missing = o.routes_error;
      else if (!o.routed_experts)
        missing = "the engine returned no routes";
      else
        reply = *o.routed_experts;
      if (!missing.empty() && opt.policy == StagePolicy::Strict) {
        x.dropped = true;
        x.warning = rollout_name(i, t) + ": " + missing;
        continue;
      }
      if (!missing.empty()) {
        reply.start = prev_len == 0 ? 0 : prev_len - 1;
        x.warning += (x.warning.empty() ? "" : " | ") + rollout_name(i, t) + ": " + missing;
      }
      try {
        StagedCall c = stage_call(reply, prev_len, T, opt.filler, opt.policy, E, t);
        if (!c.warning.empty()) x.warning += (x.warning.empty() ? "" : " | ") + c.warning;
        staged[size_t(i)].push_back(std::move(c));
        x.engine_replies.push_back(std::move(reply));
      } catch (const Error& e) {
        x.dropped = true;  // strict: the rollout is dropped
        x.warning = rollout_name(i, t) + ": " + e.what();
      }
    }
  }

  // ---- staging: assemble each rollout ---------------------------------------------------
  for (int i = 0; i < n; ++i) {
    RolloutTrace& x = tr[size_t(i)];
    if (x.dropped) continue;
    try {
      x.routes = assemble_rollout(
          staged[size_t(i)], opt.repair_boundaries ? x.engine_replies : std::vector<RouteArray>{},
          opt.repair_boundaries, &x.report);
    } catch (const Error& e) {
      if (opt.policy == StagePolicy::Strict) {
        x.dropped = true;
        x.warning = "rollout " + std::to_string(i) + ": " + e.what();
        continue;
      }
      throw;
    }
    const int S = int(x.tokens.size());
    if (x.routes.rows != S || x.routes.layers != L || x.routes.k != K || x.routes.start != 0) {
      // Lenient and nothing usable came back (e.g. every call failed): the trainer's own router.
      RouteArray all(S, L, K, int16_t(-1));
      all.moe_layers = mc.moe_layers();
      x.warning += (x.warning.empty() ? "" : " | ") + std::string("rollout ") + std::to_string(i) +
                   ": no usable routes, the trainer's router decides every row";
      x.routes = std::move(all);
    }
    x.real_route = real_route_mask(x, opt.repair_boundaries);
  }

  // ---- trainer forwards, without and with replay, in parallel over rollouts -------------
  std::vector<std::pair<int, bool>> jobs;
  for (int i = 0; i < n; ++i)
    if (!tr[size_t(i)].dropped) {
      jobs.push_back({i, false});
      jobs.push_back({i, true});
    }
  {
    const int V = trainer.config.vocab_size;
    std::atomic<size_t> next{0};
    std::mutex err_mu;
    std::exception_ptr err;
    auto work = [&]() {
      for (;;) {
        const size_t j = next.fetch_add(1);
        if (j >= jobs.size()) return;
        {
          std::lock_guard<std::mutex> lk(err_mu);
          if (err) return;
        }
        try {
          const auto [i, replay] = jobs[j];
          RolloutTrace& x = tr[size_t(i)];
          const int S = int(x.tokens.size());
          ReferenceResult rr = reference_forward(
              trainer, x.tokens, replay ? x.routes.data.data() : nullptr, replay ? S : 0);
          RouteArray routes(S, L, K);
          routes.moe_layers = x.routes.moe_layers;
          if (rr.routes.size() != routes.data.size())
            throw Error("reference_forward returned routes of an unexpected shape");
          std::copy(rr.routes.begin(), rr.routes.end(), routes.data.begin());
          std::vector<float> lp(size_t(S), std::nanf(""));
          for (int p = 1; p < S; ++p) {
            if (!x.generated[size_t(p)]) continue;
            const std::vector<float> ls =
                log_softmax(rr.logits.data() + size_t(p - 1) * size_t(V), V);
            lp[size_t(p)] = ls[size_t(x.tokens[size_t(p)])];
          }
          if (replay) {
            x.trainer_routes_with = std::move(routes);
            x.trainer_logprobs_with = std::move(lp);
          } else {
            x.trainer_routes_without = std::move(routes);
            x.trainer_logprobs_without = std::move(lp);
          }
        } catch (...) {
          std::lock_guard<std::mutex> lk(err_mu);
          if (!err) err = std::current_exception();
          return;
        }
      }
    };
    int threads =
        opt.trainer_threads > 0 ? opt.trainer_threads : int(std::thread::hardware_concurrency());
    threads = std::max(1, std::min<int>(threads, int(jobs.size())));
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& th : pool) th.join();
    if (err) std::rethrow_exception(err);
  }

  // ---- metrics --------------------------------------------------------------------------
  RolloutAlignmentResult res;
  res.rollouts = n;
  std::vector<float> eng_lp, lp_without, lp_with;
  int all_rows = 0;
  for (const auto& x : tr) {
    if (x.dropped) {
      ++res.dropped_rollouts;
      continue;
    }
    all_rows += int(x.tokens.size());
  }
  RouteArray eng_all(all_rows, L, K), without_all(all_rows, L, K), with_all(all_rows, L, K);
  const size_t row_size = size_t(L) * size_t(K);
  int at = 0;
  for (const auto& x : tr) {
    if (!x.warning.empty()) res.warnings.push_back(x.warning);
    if (x.dropped) continue;
    res.repaired_boundary_rows += x.report.repaired_boundary_rows;
    res.filler_rows += x.report.filler_rows;
    const int S = int(x.tokens.size());
    for (int p = 0; p < S; ++p, ++at) {
      if (x.real_route[size_t(p)])
        std::memcpy(eng_all.row(at), x.routes.row(p), row_size * sizeof(int16_t));
      std::memcpy(without_all.row(at), x.trainer_routes_without.row(p), row_size * sizeof(int16_t));
      std::memcpy(with_all.row(at), x.trainer_routes_with.row(p), row_size * sizeof(int16_t));
      if (!x.generated[size_t(p)]) continue;
      eng_lp.push_back(x.engine_logprobs[size_t(p)]);
      lp_without.push_back(x.trainer_logprobs_without[size_t(p)]);
      lp_with.push_back(x.trainer_logprobs_with[size_t(p)]);
    }
  }
  const std::vector<float> zeros(size_t(all_rows), 0.f);
  const RouteArray same(int(eng_lp.size()), 1, 1, int16_t(0));
  auto combine = [&](const RouteArray& trainer_routes, const std::vector<float>& trainer_lp) {
    AlignmentMetrics routers =
        compute_alignment(eng_all, trainer_routes, zeros, zeros, opt.extreme_threshold);
    AlignmentMetrics m = compute_alignment(same, same, eng_lp, trainer_lp, opt.extreme_threshold);
    m.router_disagreement_pairs = routers.router_disagreement_pairs;
    m.router_disagreement_tokens = routers.router_disagreement_tokens;
    m.mean_differing_layers = routers.mean_differing_layers;
    m.router_tokens = routers.router_tokens;
    m.skipped_route_rows = routers.skipped_route_rows;
    return m;
  };
  res.without_replay = combine(without_all, lp_without);
  res.with_replay = combine(with_all, lp_with);
  res.tokens = int(eng_lp.size());
  res.route_rows = res.with_replay.router_tokens;
  res.abs_dlogprob_without = abs_dlogprobs(eng_lp, lp_without);
  res.abs_dlogprob_with = abs_dlogprobs(eng_lp, lp_with);
  if (opt.keep_traces) res.traces = std::move(tr);
  return res;
}

RolloutAlignmentResult run_rollout_alignment(EngineConfig cfg,
                                             const std::vector<RolloutSpec>& rollouts,
                                             const RolloutAlignmentOptions& opt) {
  cfg.enable_return_routed_experts = true;
  std::shared_ptr<Checkpoint> ckpt = Checkpoint::open(cfg.model);
  Engine engine(cfg);
  return run_rollout_alignment(engine, ckpt->weights(), rollouts, opt);
}

// ---------------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------------

// The metrics of to_json(AlignmentMetrics) without its token count (the report has its own).
json alignment_metrics_json(const AlignmentMetrics& m) {
  json j = to_json(m);
  j.erase("tokens");
  return j;
}

json to_json(const RolloutAlignmentResult& r) {
  return json{{"tokens", r.tokens},
              {"repaired_boundary_rows", r.repaired_boundary_rows},
              {"filler_rows", r.filler_rows},
              {"without_replay", alignment_metrics_json(r.without_replay)},
              {"with_replay", alignment_metrics_json(r.with_replay)}};
}

std::string format_alignment_table(const RolloutAlignmentResult& r) {
  std::ostringstream o;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-28s | %16s | %16s\n", "metric", "without replay",
                "with replay");
  o << buf << std::string(28, '-') << "-+-" << std::string(16, '-') << "-+-" << std::string(16, '-')
    << "\n";
  auto line = [&](const char* name, double a, double b, const char* fmt) {
    char x[64], y[64];
    std::snprintf(x, sizeof x, fmt, a);
    std::snprintf(y, sizeof y, fmt, b);
    std::snprintf(buf, sizeof buf, "%-28s | %16s | %16s\n", name, x, y);
    o << buf;
  };
  const auto& a = r.without_replay;
  const auto& b = r.with_replay;
  line("router_disagreement_pairs", a.router_disagreement_pairs, b.router_disagreement_pairs,
       "%.6f");
  line("router_disagreement_tokens", a.router_disagreement_tokens, b.router_disagreement_tokens,
       "%.6f");
  line("mean_differing_layers", a.mean_differing_layers, b.mean_differing_layers, "%.6f");
  line("k3_kl", a.k3_kl, b.k3_kl, "%.6e");
  line("extreme_token_fraction", a.extreme_token_fraction, b.extreme_token_fraction, "%.6f");
  line("mean_abs_dlogprob", a.mean_abs_dlogprob, b.mean_abs_dlogprob, "%.6e");
  line("max_abs_dlogprob", a.max_abs_dlogprob, b.max_abs_dlogprob, "%.6e");
  o << "\ntokens                  " << r.tokens
    << "   (generated tokens, scored for the logprob metrics)\n"
    << "route rows              " << r.route_rows
    << "   (positions with a real engine route, scored for the router metrics; "
    << b.skipped_route_rows << " filler or -1 rows left out)\n"
    << "repaired_boundary_rows  " << r.repaired_boundary_rows << "\n"
    << "filler_rows             " << r.filler_rows << "\n"
    << "rollouts                " << r.rollouts - r.dropped_rollouts << " kept, "
    << r.dropped_rollouts << " dropped\n";
  return o.str();
}

}  // namespace r3
