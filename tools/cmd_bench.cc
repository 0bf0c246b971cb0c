// r3 bench: a fixed suite of engine workloads, each run with the engine's route option off, on
// but unused, and on with every request asking for routes, measured side by side (interleaved
// over --reps, over two builds of the engine pair; median and spread reported), beside the
// machine's streaming-read bandwidth and bf16 and fp32 FMA peaks, measured before the suite and
// again after every entry, so the fractions rest on their median and the spread shows how much
// the machine itself moved during the run. Long entries schedule their engines one at a time
// (--sequential-engines) or step two routes-on engines in turn (--paired-steps), so a routes
// ratio over minutes is not the machine's drift. One timed run: tools/bench_run.h.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "args.h"
#include "bench_run.h"
#include "bench_speculative.h"
#include "bench_startup.h"
#include "commands.h"
#include "core/error.h"
#include "core/resident_memory.h"
#include "core/rng.h"
#include "engine_flags.h"
#include "kernels/attention_choice.h"
#include "kernels/machine_limits.h"
#include "kernels/tile_choice.h"
#include "model/checkpoint.h"

namespace r3::cli {

using json = nlohmann::json;

namespace {

// Median, min and max of samples (empty: zeros).
struct Spread {
  double median = 0, min = 0, max = 0;
};
Spread spread_of(std::vector<double> v) {
  Spread s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  s.min = v.front();
  s.max = v.back();
  return s;
}
json spread_json(const Spread& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

// A fraction of a machine limit, or a flag where the achieved rate exceeds it (the limit was
// measured low, or the entry reads from cache): never a fraction over 100%.
std::string fraction(double achieved, double limit) {
  char b[32];
  if (achieved > limit) return "> limit";
  std::snprintf(b, sizeof b, "%.0f%%", 100 * achieved / limit);
  return b;
}

// Refit cost: from disk (read, validate, swap, repack) and from tensors in memory (check, adopt
// the buffers, repack), each against one pass over the weights at the measured read bandwidth;
// and what release_memory_occupation gives back.
json bench_weight_sync(const EngineConfig& cfg, const kernels::MachineLimits& m, int reps) {
  Engine e(cfg);
  std::vector<TensorToWrite> tensors = e.checkpoint().stored_tensors();
  double bytes = 0;
  for (auto& t : tensors) bytes += double(t.bytes.size());
  double disk = 1e30, memory = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    e.update_weights(cfg.model, true);
    auto t1 = std::chrono::steady_clock::now();
    disk = std::min(disk, std::chrono::duration<double>(t1 - t0).count());
    std::vector<TensorToWrite> copy = tensors;  // the trainer's tensors, outside the timing
    t0 = std::chrono::steady_clock::now();
    e.stage_weights(std::move(copy));
    e.commit_staged_weights(true);
    t1 = std::chrono::steady_clock::now();
    memory = std::min(memory, std::chrono::duration<double>(t1 - t0).count());
  }
  tensors.clear();
  tensors.shrink_to_fit();
  const double one_pass = bytes / (m.read_gb_per_s * 1e9);
  const double rss0 = resident_mb();
  e.release_memory(true, true);
  const double rss1 = resident_mb();
  e.resume_memory(true, true);
  const double rss2 = resident_mb();
  std::printf("weight_sync    %.2f GB of weights; one pass at the read bandwidth %.3f s\n",
              bytes / 1e9, one_pass);
  std::printf("  from disk    %.3f s  (%.2f GB/s, %.1fx one pass)\n", disk, bytes / disk / 1e9,
              disk / one_pass);
  std::printf("  in memory    %.3f s  (%.2f GB/s, %.1fx one pass)\n", memory, bytes / memory / 1e9,
              memory / one_pass);
  std::printf(
      "  RSS          %.0f MB -> %.0f MB after release_memory (kv_cache, weights) -> %.0f MB after "
      "resume\n",
      rss0, rss1, rss2);
  return {{"name", "weight_sync"},
          {"weight_bytes", bytes},
          {"disk_s", disk},
          {"memory_s", memory},
          {"one_pass_s", one_pass},
          {"disk_over_one_pass", disk / one_pass},
          {"memory_over_one_pass", memory / one_pass},
          {"rss_mb_before_release", rss0},
          {"rss_mb_released", rss1},
          {"rss_mb_resumed", rss2},
          {"machine_read_gb_per_s", m.read_gb_per_s}};
}

// Expert parallelism: an entry on the --expert-parallel ranks against one process running every
// rank's threads, routes on in both, the two engines taking turns; and the resident memory of
// each rank (the EP engine built first, before the one-process engine exists) and of the one
// process (what building its engine added).
struct ExpertParallelRow {
  Entry en;
  Spread one, ranks;
  int one_threads = 0;
  std::vector<double> rank_mb;
  double one_mb = 0;
};

ExpertParallelRow compare_expert_parallel(const EngineConfig& cfg, const Entry& en, int reps,
                                          uint64_t& run) {
  ExpertParallelRow row;
  row.en = en;
  EngineConfig one = cfg;
  one.expert_parallel = 1;
  one.threads = (cfg.threads > 0 ? cfg.threads : int(std::thread::hardware_concurrency())) *
                cfg.expert_parallel;
  row.one_threads = one.threads;
  Engine ep(cfg);
  run_entry(ep, en, true, run++);  // warm-up: pages in the weights and the KV it uses
  row.rank_mb = ep.resident_mb_by_rank();
  const double before = resident_mb();
  Engine solo(one);
  run_entry(solo, en, true, run++);
  row.one_mb = resident_mb() - before;
  std::vector<double> a, b;
  for (int rep = 0; rep < reps; ++rep) {
    if (rep % 2 == 0) a.push_back(run_entry(solo, en, true, run++).tokens_per_s);
    b.push_back(run_entry(ep, en, true, run++).tokens_per_s);
    if (rep % 2 == 1) a.push_back(run_entry(solo, en, true, run++).tokens_per_s);
  }
  row.one = spread_of(a);
  row.ranks = spread_of(b);
  return row;
}

void print_expert_parallel(const std::vector<ExpertParallelRow>& rows, int ranks, int threads,
                           json& results) {
  std::printf(
      "expert parallelism: %d ranks x %d threads against 1 process x %d threads, routes on in "
      "both\n",
      ranks, threads, rows.empty() ? 0 : rows[0].one_threads);
  std::printf("%-16s %26s %26s %8s  %s\n", "entry", "tok/s 1 process [min-max]",
              "tok/s ranks [min-max]", "ratio",
              "resident MB: each rank's (engine alone) | the one process's engine");
  for (const ExpertParallelRow& r : rows) {
    char one[64], many[64];
    std::snprintf(one, sizeof one, "%.1f [%.1f-%.1f]", r.one.median, r.one.min, r.one.max);
    std::snprintf(many, sizeof many, "%.1f [%.1f-%.1f]", r.ranks.median, r.ranks.min, r.ranks.max);
    std::string mb;
    for (size_t i = 0; i < r.rank_mb.size(); ++i)
      mb += (i ? ", " : "") + std::to_string(int(r.rank_mb[i]));
    std::printf("%-16s %26s %26s %8.3f  %s | %.0f\n", r.en.name.c_str(), one, many,
                r.ranks.median / r.one.median, mb.c_str(), r.one_mb);
    results.push_back({{"name", r.en.name},
                       {"expert_parallel", ranks},
                       {"threads_per_rank", threads},
                       {"one_process_threads", r.one_threads},
                       {"tokens_per_s_one_process", r.one.median},
                       {"tokens_per_s_one_process_spread", spread_json(r.one)},
                       {"tokens_per_s_ranks", r.ranks.median},
                       {"tokens_per_s_ranks_spread", spread_json(r.ranks)},
                       {"ratio", r.ranks.median / r.one.median},
                       {"resident_mb_by_rank", r.rank_mb},
                       {"resident_mb_one_process_engine", r.one_mb}});
  }
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  Args a(
      "bench",
      "Runs the benchmark suite (decode_b1, decode_b8, decode_b32, prefill_2k, mixed_rollout; "
      "decode_b32_ctx8k and\n"
      "rollout_long on request) with routes off\n"
      "(decode_b1_spec, decode_b8_spec, decode_b32_spec, on request: speculative decoding against\n"
      "none on prompts the output can copy, with the drafts' acceptance)\n"
      "and on, side by side, and prints tokens/s, achieved weight bandwidth against the measured\n"
      "streaming-read bandwidth, achieved FLOP/s against the measured bf16 peak, and the routes\n"
      "on/off ratio; weight_sync times a refit from disk and from tensors in memory against one\n"
      "pass over the weights at the measured read bandwidth, and the RSS that\n"
      "release_memory_occupation gives back. Use a bench-preset model: r3 make-model --preset "
      "bench --out DIR.\n"
      "With --expert-parallel N (under mpirun -np N --bind-to none) each entry runs on the N ranks "
      "and on one\n"
      "process with every rank's threads, routes on, side by side, with each rank's resident "
      "memory.");
  add_engine_flags(a);
  a.opt("suite", "decode_b1,decode_b8,decode_b32,prefill_2k,mixed_rollout,weight_sync",
        "entries to run (also: decode_b32_ctx8k, rollout_long, startup: start to first token of a "
        "fresh engine\n"
        "against reading the files once and first-touching its peak resident bytes, and that peak "
        "against the\n"
        "checkpoint + KV pool; decode_b1_spec, decode_b8_spec, decode_b32_spec)")
      .opt("reps", "3",
           "repetitions per mode, alternating between two builds of the engine pair unless "
           "--sequential-engines or --paired-steps (median and spread reported)")
      .opt("decode-tokens", "32", "generated tokens per request in decode entries")
      .opt(
          "batch-sizes", "",
          "decode entries as batch sizes, e.g. 1,8,32 (decode_b1, decode_b8, decode_b32: that many "
          "requests decoding\n"
          "together); they replace the suite's decode_bN entries, in this order, ahead of the rest")
      .opt("prefill-tokens", "2048", "prompt length of prefill_2k")
      .opt("json", "", "write the results as a JSON list here")
      .flag("sequential-engines", false,
            "build each entry's two engines one at a time (routes-on, then routes-off) instead of "
            "side by side: for "
            "long entries whose two KV pools do not fit in memory together (rollout_long)")
      .flag("paired-steps", false,
            "measure routes on against on-but-unused on two routes-on engines stepped in turn, one "
            "step each, so the "
            "machine's drift over a long entry falls on both alike; then the routes-off engine "
            "alone. Holds two KV "
            "pools at once (rollout_long on the bench preset: --kv-cache-mb 6800)");
  if (!a.parse(argc, argv)) return 0;
  EngineConfig base = engine_config_from(a);
  enum class Schedule { SideBySide, Sequential, PairedSteps };
  if (a.on("sequential-engines") && a.on("paired-steps"))
    throw Error(
        "r3 bench: --sequential-engines and --paired-steps are two ways to schedule the engines; "
        "pick one");
  if (base.expert_parallel > 1 && (a.on("sequential-engines") || a.on("paired-steps")))
    throw Error(
        "r3 bench: --expert-parallel compares ranks with one process and takes neither "
        "--sequential-engines "
        "nor --paired-steps");
  const Schedule schedule = a.on("paired-steps")         ? Schedule::PairedSteps
                            : a.on("sequential-engines") ? Schedule::Sequential
                                                         : Schedule::SideBySide;
  const int reps = int(a.integer("reps"));
  if (reps < 1) throw Error("r3 bench: --reps must be at least 1");
  const int dec = int(a.integer("decode-tokens")), pre = int(a.integer("prefill-tokens"));
  std::vector<Entry> all = {
      {"decode_b1", 1, 16, 0, dec, Entry::Decode},
      {"decode_b8", 8, 16, 0, dec, Entry::Decode},
      {"decode_b32", 32, 16, 0, dec, Entry::Decode},
      {"prefill_2k", 1, pre, 0, 1, Entry::Prefill},
      // A prefix hit against the same prompt without one (not in the default suite).
      {"prefill_1k", 1, 1024, 0, 1, Entry::Prefill},
      {"prefill_1k_hit896", 1, 1024, 896, 1, Entry::Prefill},
      {"mixed_rollout", 32, 160, 128, 2 * dec, Entry::Total},
      // RL-shaped, long: not in the default suite (minutes per repetition on the bench preset).
      {"decode_b32_ctx8k", 32, 8192, 0, dec, Entry::Decode},
      {"rollout_long", 64, 1024, 896, 2048, Entry::Total},
      // Speculative decoding against none, on a workload whose drafts can be right
      // (Entry::copyable).
      {"decode_b1_spec", 1, 128, 0, 2 * dec, Entry::Decode, true},
      {"decode_b8_spec", 8, 128, 0, 2 * dec, Entry::Decode, true},
      {"decode_b32_spec", 32, 128, 0, 2 * dec, Entry::Decode, true},
  };
  std::vector<Entry> suite;
  std::stringstream ss(a.str("suite"));
  bool weight_sync = false, startup = false;
  for (std::string n; std::getline(ss, n, ',');) {
    bool found = n == "weight_sync" || n == "startup";
    weight_sync |= n == "weight_sync";
    startup |= n == "startup";
    for (auto& en : all)
      if (en.name == n) suite.push_back(en), found = true;
    if (!found) throw Error("r3 bench: unknown suite entry \"" + n + "\"");
  }
  if (const std::string sizes = a.str("batch-sizes"); !sizes.empty()) {
    // decode_bN for each N given, in order, in place of the suite's own decode_bN entries.
    auto is_decode_bn = [](const Entry& en) {
      return en.name.rfind("decode_b", 0) == 0 && en.name.size() > 8 &&
             en.name.find_first_not_of("0123456789", 8) == std::string::npos;
    };
    std::vector<Entry> decode;
    std::stringstream bs(sizes);
    for (std::string n; std::getline(bs, n, ',');) {
      int b = 0;
      if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos ||
          (b = std::atoi(n.c_str())) < 1 || b > 4096)
        throw Error(
            "r3 bench: --batch-sizes takes batch sizes from 1 to 4096 separated by commas, got \"" +
            sizes + "\"");
      decode.push_back({"decode_b" + std::to_string(b), b, 16, 0, dec, Entry::Decode});
    }
    suite.erase(std::remove_if(suite.begin(), suite.end(), is_decode_bn), suite.end());
    suite.insert(suite.begin(), decode.begin(), decode.end());
  }
  if (startup && base.expert_parallel > 1)
    throw Error("r3 bench: the startup entry runs one process; leave out --expert-parallel");
  // First, while this process has no threads (it forks a child per repetition).
  const json startup_result = startup ? bench_startup(base, reps) : json();
  ThreadPool probe_pool(base.threads > 0 ? base.threads : int(std::thread::hardware_concurrency()));
  std::vector<kernels::MachineLimits> machine = {kernels::measure_machine(&probe_pool)};
  const kernels::MachineLimits m0 = machine[0];  // a copy: machine grows below
  const kernels::TileChoice& tiles = kernels::tuned_bf16_tiles();
  std::printf(
      "machine: %s kernels, bf16 peak instruction %s, %d threads (limits measured before the suite "
      "and after "
      "every entry; table below)\n",
      m0.kernels.c_str(), m0.peak_instruction.c_str(), probe_pool.size());
  std::printf("bf16 tiles for 2+ tokens: %s (%s", kernels::bf16_tiles_name(tiles.tiles),
              tiles.source.c_str());
  if (tiles.fma_gflops > 0)
    std::printf("; one thread, 64 tokens: fma %.0f GFLOP/s, dp %.0f GFLOP/s", tiles.fma_gflops,
                tiles.dp_gflops);
  std::printf(")\n");
  const kernels::AttentionChoice& attention = kernels::tuned_decode_attention();
  std::printf("decode attention loop: %s (%s", kernels::decode_attention_name(attention.loop),
              attention.source.c_str());
  if (attention.heads_gb_per_s > 0)
    std::printf("; every thread, scattered bf16 KV: heads %.1f GB/s, per_head %.1f GB/s",
                attention.heads_gb_per_s, attention.per_head_gb_per_s);
  std::printf(")\n");
  std::fflush(stdout);
  // Entries adapt to the model: a prompt never runs past the positions it allows (less one
  // generated token).
  int max_positions = 0, kv_tokens = 0;
  bool model_is_hybrid = false, prefix_caching = base.enable_prefix_caching;
  uint64_t recurrent_state_bytes = 0;
  {
    Engine probe(base);
    max_positions = probe.model_config().max_position_embeddings;
    kv_tokens = probe.stats().num_blocks * probe.stats().block_size;
    model_is_hybrid = probe.model_config().hybrid();
    recurrent_state_bytes = probe.recurrent_state_bytes_per_request();
    prefix_caching = probe.config().enable_prefix_caching;  // as the engine resolved it
  }
  struct Row {
    Entry en;
    Spread off, unused, on, gb, gflops, kv, attention_kv, route_work;
    double ratio;
    uint64_t preemptions;
    std::vector<double> paired_ratios;
    Spread deltanet = {};  // hybrids: share of the timed span in Gated DeltaNet blocks
    Spread seconds = {};   // the timed span (routes off, engine option on)
  };
  std::vector<Row> rows;
  std::vector<ExpertParallelRow> ep_rows;
  json speculative = json::array();  // the _spec entries' results
  uint64_t ep_run = 0;
  for (Entry en : suite) {
    // ... nor past what the KV pool holds for all of the entry's requests at once (no preemption
    // inside a measurement; the shared prefixes once when the prefix cache shares them).
    const bool caching = (en.shared_prefix > 0 || en.measure == Entry::Decode) && prefix_caching;
    Entry fitted = en;
    fitted.prompt_len = std::min(en.prompt_len, max_positions - en.max_tokens - 1);
    while (fitted.prompt_len >= 16 &&
           kv_tokens_needed(fitted, caching, base.block_size) > kv_tokens)
      --fitted.prompt_len;
    if (fitted.prompt_len < 16) {
      std::fprintf(stderr,
                   "r3 bench: %s skipped: %d requests of %d generated tokens do not fit the KV "
                   "pool (%d tokens)\n",
                   en.name.c_str(), en.requests, en.max_tokens, kv_tokens);
      continue;
    }
    if (fitted.prompt_len < en.prompt_len) {
      std::fprintf(
          stderr,
          "r3 bench: %s runs %d-token prompts, not %d (the model allows %d positions; the KV pool "
          "holds %d tokens)\n",
          en.name.c_str(), fitted.prompt_len, en.prompt_len, max_positions, kv_tokens);
      en.prompt_len = fitted.prompt_len;
      en.shared_prefix = std::min(en.shared_prefix, en.prompt_len);
    }
    std::fprintf(stderr, "r3 bench: running %s\n", en.name.c_str());
    EngineConfig cfg = base;
    cfg.max_num_seqs = std::max(cfg.max_num_seqs, en.requests);
    if (en.measure == Entry::Prefill)
      cfg.max_num_batched_tokens = std::max(cfg.max_num_batched_tokens, en.prompt_len);
    cfg.enable_prefix_caching = caching;
    EngineConfig cfg_off = cfg;
    cfg_off.enable_return_routed_experts = false;
    cfg.enable_return_routed_experts = true;
    if (base.expert_parallel > 1) {
      ep_rows.push_back(compare_expert_parallel(cfg, en, reps, ep_run));
      continue;
    }
    if (en.copyable) {
      speculative.push_back(bench_speculative(cfg, en, reps, ep_run));
      continue;
    }
    std::vector<double> off, unused, on, gb, gflops, kv, attention_kv, route_work, deltanet,
        seconds;
    std::vector<double>
        paired_ratios;  // --paired-steps: routes on / on-but-unused of each repetition
    uint64_t preemptions = 0;
    auto keep_off = [&](const Timing& t) {
      off.push_back(t.tokens_per_s);
      preemptions += t.preemptions;
    };
    auto keep_unused = [&](const Timing& t) {
      unused.push_back(t.tokens_per_s);
      preemptions += t.preemptions;
      gb.push_back(t.weight_gb_per_s);
      gflops.push_back(t.gflops);
      kv.push_back(t.kv_gb_per_s);
      attention_kv.push_back(t.attention_kv_gb_per_s);
      deltanet.push_back(t.deltanet_fraction);
      seconds.push_back(t.seconds);
    };
    auto keep_on = [&](const Timing& t) {
      on.push_back(t.tokens_per_s);
      route_work.push_back(t.route_fraction);
      preemptions += t.preemptions;
    };
    uint64_t run = 0;
    // The long entries' warm-ups stop after 16 generated tokens: they page in the weights, and
    // the entries that need them run for minutes.
    Entry warm = en;
    warm.max_tokens = std::min(en.max_tokens, 16);
    if (schedule == Schedule::Sequential) {
      // One engine at a time: the routes-on engine (unused and on take turns going first), then
      // the routes-off one.
      {
        Engine e_on(cfg);
        run_entry(e_on, warm, true, run++);
        for (int rep = 0; rep < reps; ++rep)
          for (int k = 0; k < 2; ++k)
            if ((rep + k) % 2 == 0)
              keep_unused(run_entry(e_on, en, false, run++));
            else
              keep_on(run_entry(e_on, en, true, run++));
      }
    } else if (schedule == Schedule::PairedSteps) {
      // Two routes-on engines stepped in turn, one asking for routes and one not; the engine
      // that asks alternates over the repetitions (where each one's packed weights landed
      // differs). They share one checkpoint, so memory holds the stored weights once (two KV
      // pools do not leave room for two copies: rollout_long). Then the routes-off engine alone.
      {
        auto shared = Checkpoint::open(cfg.model);
        Engine first(cfg, shared), second(cfg, shared);
        run_entries_paired(first, true, second, true, warm, run++);
        for (int rep = 0; rep < reps; ++rep) {
          const bool first_asks = rep % 2 == 0;
          const auto [f, s] = run_entries_paired(first, first_asks, second, !first_asks, en, run++);
          const Timing& asking = first_asks ? f : s;
          const Timing& not_asking = first_asks ? s : f;
          keep_on(asking);
          keep_unused(not_asking);
          paired_ratios.push_back(asking.tokens_per_s / not_asking.tokens_per_s);
        }
      }
    }
    if (schedule != Schedule::SideBySide) {
      // Both schedules then run the routes-off engine alone, once the routes-on engines are gone.
      Engine e_off(cfg_off);
      run_entry(e_off, warm, false, run++);
      for (int rep = 0; rep < reps; ++rep) keep_off(run_entry(e_off, en, false, run++));
    }
    // Two builds of the engine pair, in opposite orders: the engine built first has measured 1-3%
    // slower in either role (where its packed weights land), so the repetitions alternate
    // between the builds. Within a build the three modes take turns going first.
    const int pair_builds = schedule == Schedule::SideBySide ? std::min(2, reps) : 0;
    for (int build = 0; build < pair_builds; ++build) {
      std::optional<Engine> e_off, e_on;
      if (build == 0)
        e_off.emplace(cfg_off), e_on.emplace(cfg);
      else
        e_on.emplace(cfg), e_off.emplace(cfg_off);
      run_entry(*e_off, en, false, run++);  // warm-ups (page in the weights)
      run_entry(*e_on, en, true, run++);
      for (int rep = build; rep < reps; rep += 2)
        for (int k = 0; k < 3; ++k) switch ((rep + k) % 3) {
            case 0:
              keep_off(run_entry(*e_off, en, false, run++));
              break;
            case 1:
              keep_unused(run_entry(*e_on, en, false, run++));
              break;
            default:
              keep_on(run_entry(*e_on, en, true, run++));
              break;
          }
    }
    if (preemptions > 0)
      std::fprintf(
          stderr,
          "r3 bench: %s: %llu preemptions in the timed runs (the KV pool is short of the entry's "
          "%lld tokens): its figures include recomputation\n",
          en.name.c_str(), static_cast<unsigned long long>(preemptions),
          static_cast<long long>(kv_tokens_needed(en, caching, base.block_size)));
    Row row{en,
            spread_of(off),
            spread_of(unused),
            spread_of(on),
            spread_of(gb),
            spread_of(gflops),
            spread_of(kv),
            spread_of(attention_kv),
            spread_of(route_work),
            0,
            preemptions,
            paired_ratios};
    row.deltanet = spread_of(deltanet);
    row.seconds = spread_of(seconds);
    row.ratio = row.on.median / row.unused.median;
    rows.push_back(row);
    machine.push_back(kernels::measure_machine(&probe_pool));
  }
  if (base.expert_parallel > 1) {
    json results = json::array();
    print_expert_parallel(
        ep_rows, base.expert_parallel,
        base.threads > 0 ? base.threads : int(std::thread::hardware_concurrency()), results);
    if (weight_sync)
      std::fprintf(
          stderr,
          "r3 bench: weight_sync skipped: refit is not supported with expert parallelism\n");
    if (!a.str("json").empty()) {
      std::ofstream out(a.str("json"));
      if (!out) throw Error(a.str("json") + ": cannot open for writing");
      out << results.dump(2) << "\n";
    }
    return 0;
  }
  // The limits: median and spread over every measurement of this run.
  std::vector<double> reads, peaks, fmas;
  for (const auto& mm : machine)
    reads.push_back(mm.read_gb_per_s), peaks.push_back(mm.peak_gflops),
        fmas.push_back(mm.fma_peak_gflops);
  const Spread read = spread_of(reads), peak = spread_of(peaks), fma = spread_of(fmas);
  std::printf(
      "limits over %zu measurements: streaming read %.1f GB/s [%.1f-%.1f], bf16 peak %.0f GFLOP/s "
      "[%.0f-%.0f], "
      "fp32 fma peak %.0f GFLOP/s [%.0f-%.0f]; fractions below are of the medians\n",
      machine.size(), read.median, read.min, read.max, peak.median, peak.min, peak.max, fma.median,
      fma.min, fma.max);
  std::printf("%-16s %12s %20s %12s %8s %10s %10s %8s %8s %8s %9s %8s %10s %8s %8s\n", "entry",
              "tok/s opt-off", "routes off [min-max]", "routes on", "ratio", "route work",
              "weight GB/s", "of read", "KV GB/s", "of read", "attn KV", "of read", "GFLOP/s",
              "of bf16", "of fma");
  json results = json::array();
  for (const Row& r : rows) {
    char off_range[48];
    std::snprintf(off_range, sizeof off_range, "%.1f [%.1f-%.1f]", r.unused.median, r.unused.min,
                  r.unused.max);
    char route_work[24];
    std::snprintf(route_work, sizeof route_work, "%.3f%%", 100 * r.route_work.median);
    // Attention's own KV rate only for decode: a prefill chunk's queries share each load of K and
    // V (kernels/attention.h groups), so its KV bytes per token are not bytes from memory.
    char attention_kv[24] = "-";
    std::string attention_kv_fraction = "-";
    if (r.en.measure == Entry::Decode) {
      std::snprintf(attention_kv, sizeof attention_kv, "%.2f", r.attention_kv.median);
      attention_kv_fraction = fraction(r.attention_kv.median, read.median);
    }
    std::printf("%-16s %12.1f %20s %12.1f %8.3f %10s %10.2f %8s %8.2f %8s %9s %8s %10.1f %8s %8s\n",
                r.en.name.c_str(), r.off.median, off_range, r.on.median, r.ratio, route_work,
                r.gb.median, fraction(r.gb.median, read.median).c_str(), r.kv.median,
                fraction(r.kv.median, read.median).c_str(), attention_kv,
                attention_kv_fraction.c_str(), r.gflops.median,
                fraction(r.gflops.median, peak.median).c_str(),
                fraction(r.gflops.median, fma.median).c_str());
    json j = {{"name", r.en.name},
              {"prompt_len", r.en.prompt_len},
              {"requests", r.en.requests},
              {"tokens_per_s_routes_off", r.unused.median},
              {"tokens_per_s_routes_off_spread", spread_json(r.unused)},
              {"tokens_per_s_routes_on", r.on.median},
              {"tokens_per_s_routes_on_spread", spread_json(r.on)},
              {"tokens_per_s_engine_option_off", r.off.median},
              {"routes_ratio", r.ratio},
              {"preemptions", r.preemptions},
              {"route_work_fraction", r.route_work.median},
              {"engine_option_ratio", r.unused.median / r.off.median},
              {"weight_gb_per_s", r.gb.median},
              {"kv_gb_per_s", r.kv.median},
              {"gflops", r.gflops.median},
              {"machine_kernels", m0.kernels},
              {"machine_read_gb_per_s", spread_json(read)},
              {"machine_peak_gflops", spread_json(peak)},
              {"machine_fma_peak_gflops", spread_json(fma)},
              {"weight_bandwidth_over_read", r.gb.median > read.median}};
    // Each paired repetition's own ratio: the asking engine alternates, so a gap that flips sign
    // with it is where the engines' weights landed, not the routes.
    if (!r.paired_ratios.empty()) j["routes_ratio_per_pair"] = r.paired_ratios;
    if (model_is_hybrid) {
      j["deltanet_fraction"] = r.deltanet.median;
      j["recurrent_state_bytes_per_request"] = recurrent_state_bytes;
      std::printf("%-16s Gated DeltaNet blocks (projections included): %.1f%% of the timed span\n",
                  r.en.name.c_str(), 100 * r.deltanet.median);
    }
    if (r.en.measure == Entry::Decode) {
      j["weight_bandwidth_fraction"] = std::min(1.0, r.gb.median / read.median);
      j["attention_kv_gb_per_s"] = r.attention_kv.median;
      j["attention_kv_gb_per_s_spread"] = spread_json(r.attention_kv);
      j["attention_kv_over_read"] = r.attention_kv.median > read.median;
    } else {
      if (r.en.measure == Entry::Prefill) j["seconds"] = r.seconds.median;
      if (r.en.shared_prefix > 0) j["cached_prefix"] = r.en.shared_prefix;
      j["flops_fraction"] = r.gflops.median / peak.median;
      j["fma_flops_fraction"] = r.gflops.median / fma.median;
    }
    results.push_back(j);
  }
  // A prefix hit's prefill against the same prompt's without one, both measured in this run.
  for (const Row& hit : rows)
    for (const Row& cold : rows)
      if (hit.en.measure == Entry::Prefill && cold.en.measure == Entry::Prefill &&
          hit.en.shared_prefix > 0 && cold.en.shared_prefix == 0 &&
          hit.en.prompt_len == cold.en.prompt_len && cold.seconds.median > 0)
        std::printf(
            "%s: a %d-token prompt with %d tokens cached prefills in %.4f s, %.1f%% of the %.4f s "
            "of %s "
            "(routes off, medians)\n",
            hit.en.name.c_str(), hit.en.prompt_len, hit.en.shared_prefix, hit.seconds.median,
            100 * hit.seconds.median / cold.seconds.median, cold.seconds.median,
            cold.en.name.c_str());
  std::fflush(stdout);
  kernels::MachineLimits m = m0;
  m.read_gb_per_s = read.median;
  for (const json& j : speculative) results.push_back(j);
  if (weight_sync) results.push_back(bench_weight_sync(base, m, reps));
  if (startup) results.push_back(startup_result);
  if (!a.str("json").empty()) {
    std::ofstream out(a.str("json"));
    if (!out) throw Error(a.str("json") + ": cannot open for writing");
    out << results.dump(2) << "\n";
  }
  return 0;
}

}  // namespace r3::cli
