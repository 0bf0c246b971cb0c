// r3 align: multi-turn rollouts on the engine with routes, staged for training, replayed through
// the trainer forward; reports the train/inference mismatch without and with replay.
#include <cstdio>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "engine_flags.h"
#include "model/config.h"
#include "staging/rollout_alignment.h"

namespace r3::cli {

int cmd_align(int argc, char** argv) {
  Args a(
      "align",
      "Runs multi-turn rollouts on the engine with routes, stages every call (filler row +\n"
      "[prev_len:] cut, turn-boundary repair), then runs the trainer forward (fp32 reference)\n"
      "over each rollout without and with replay of the staged routes, and reports the\n"
      "train/inference mismatch both ways.\n"
      "\n"
      "Rollouts: --input FILE, one JSON object per line,\n"
      "  {\"prompt_token_ids\":[...], \"turns\":[[user tokens of turn 2], [... turn 3], ...]}\n"
      "(\"turns\" optional), or --num-prompts N seeded random ones with --turns turns each.\n"
      "Turn t's prompt = every token so far + its user tokens; each turn samples --max-tokens\n"
      "tokens (seed of rollout i, turn t derived from --seed); turns after the first ask for\n"
      "routes from prev_len - 1 so boundary repair has the real route of the previous turn's\n"
      "last token.\n"
      "\n"
      "Scored: logprob metrics (k3_kl, extreme_token_fraction, |dlogprob|) over the generated\n"
      "tokens, engine logprob vs log_softmax of the trainer logits; router metrics over every\n"
      "position whose staged row holds a real engine route (filler and -1 rows left out), engine\n"
      "expert sets vs the experts the trainer forward used.");
  add_engine_flags(a);
  a.opt("input", "", "rollouts JSONL (see above); or use --num-prompts")
      .opt("num-prompts", "0", "seeded random rollouts instead of --input")
      .opt("turns", "3", "turns per random rollout (--num-prompts only)")
      .opt("max-tokens", "16", "tokens generated per turn")
      .opt("temperature", "1", "engine sampling temperature (0 = greedy)")
      .opt("top-p", "1", "engine nucleus sampling")
      .opt("top-k", "0", "engine top-k sampling (0 = off)")
      .flag("ignore-eos", true, "keep generating past eos, so every turn has --max-tokens tokens")
      .opt("filler", "minus_one",
           "filler row of each call's last token: minus_one | arange | spread")
      .opt("policy", "strict",
           "bad or missing routes: strict (drop the rollout) | lenient (drop the call's routes: -1 "
           "rows)")
      .flag("repair-boundaries", true,
            "overwrite a turn's last filler row with the next call's real route")
      .opt("seed", "0", "seed of the random rollouts and of the sampling")
      .opt("trainer-threads", "0", "threads for the trainer forwards (0 = all cores)")
      .opt("json", "", "write the report as JSON here (- = stdout, the table then goes to stderr)")
      .opt("plot", "", "write an SVG histogram of |dlogprob| without and with replay here");
  if (!a.parse(argc, argv)) return 0;

  const bool have_input = !a.str("input").empty();
  const int64_t num_prompts = a.integer("num-prompts");
  if (have_input == (num_prompts > 0))
    throw Error("r3 align: give exactly one of --input FILE and --num-prompts N");
  if (num_prompts < 0) throw Error("r3 align: --num-prompts must be positive");
  if (have_input && a.given("turns"))
    throw Error(
        "r3 align: --turns applies to --num-prompts; with --input each line's \"turns\" sets them");
  if (a.given("enable-return-routed-experts") && !a.on("enable-return-routed-experts"))
    throw Error("r3 align: needs routes; --no-enable-return-routed-experts cannot be used");

  RolloutAlignmentOptions opt;
  opt.max_tokens = int(a.integer("max-tokens"));
  if (opt.max_tokens < 1) throw Error("r3 align: --max-tokens must be >= 1");
  opt.temperature = float(a.number("temperature"));
  opt.top_p = float(a.number("top-p"));
  opt.top_k = int(a.integer("top-k"));
  opt.ignore_eos = a.on("ignore-eos");
  opt.seed = uint64_t(a.integer("seed"));
  opt.trainer_threads = int(a.integer("trainer-threads"));
  opt.repair_boundaries = a.on("repair-boundaries");
  opt.keep_traces = false;
  const std::string filler = a.str("filler"), policy = a.str("policy");
  opt.filler = parse_filler(filler);
  if (policy == "strict")
    opt.policy = StagePolicy::Strict;
  else if (policy == "lenient")
    opt.policy = StagePolicy::Lenient;
  else
    throw Error("r3 align: --policy must be strict or lenient, got \"" + policy + "\"");

  EngineConfig cfg = engine_config_from(a);
  cfg.enable_return_routed_experts = true;
  const ModelConfig mc = load_config(cfg.model + "/config.json");

  std::vector<RolloutSpec> rollouts;
  int turns_shown = 0;
  if (have_input) {
    std::ifstream in(a.str("input"));
    if (!in) throw Error(a.str("input") + ": cannot open");
    rollouts = read_rollouts_jsonl(in, a.str("input"));
    if (rollouts.empty()) throw Error(a.str("input") + ": no rollouts");
  } else {
    RandomRolloutOptions ro;
    ro.num_rollouts = int(num_prompts);
    ro.turns = int(a.integer("turns"));
    if (ro.turns < 1) throw Error("r3 align: --turns must be >= 1");
    ro.seed = opt.seed;
    rollouts = random_rollouts(ro, mc.vocab_size, mc.bos_token_id, mc.eos_token_id);
    turns_shown = ro.turns;
  }

  RolloutAlignmentResult r = run_rollout_alignment(cfg, rollouts, opt);

  for (const auto& w : r.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
  // The table goes to stdout, or to stderr when the JSON takes stdout (--json -).
  const std::string json_path = a.str("json");
  FILE* table = json_path == "-" ? stderr : stdout;
  std::fprintf(table, "r3 align: %s, %zu rollouts", cfg.model.c_str(), rollouts.size());
  if (turns_shown) std::fprintf(table, " x %d turns", turns_shown);
  std::fprintf(table, ", %d tokens per turn, filler %s, policy %s, boundary repair %s\n\n",
               opt.max_tokens, filler.c_str(), policy.c_str(),
               opt.repair_boundaries ? "on" : "off");
  std::fputs(format_alignment_table(r).c_str(), table);
  std::fflush(table);

  if (!json_path.empty()) {
    const std::string text = to_json(r).dump(2) + "\n";
    if (json_path == "-") {
      std::fputs(text.c_str(), stdout);
    } else {
      std::ofstream f(json_path);
      if (!f || !(f << text)) throw Error(json_path + ": cannot write");
    }
  }
  const std::string plot = a.str("plot");
  if (!plot.empty()) {
    std::ofstream f(plot);
    if (!f || !(f << dlogprob_histogram_svg(r.abs_dlogprob_without, r.abs_dlogprob_with)))
      throw Error(plot + ": cannot write");
  }
  return r.dropped_rollouts == r.rollouts ? 1 : 0;
}

}  // namespace r3::cli
