#include "bench_speculative.h"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace r3::cli {

namespace {
double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
}  // namespace

nlohmann::json bench_speculative(const EngineConfig& cfg, const Entry& en, int reps,
                                 uint64_t& run) {
  EngineConfig off = cfg, on = cfg;
  off.speculative_algorithm.clear();
  if (on.speculative_algorithm.empty()) on.speculative_algorithm = "NGRAM";
  Engine e_off(off), e_on(on);
  run_entry(e_off, en, true, run++);  // warm-ups (page in the weights)
  run_entry(e_on, en, true, run++);
  std::vector<double> t_off, t_on;
  const EngineStats before = e_on.stats();
  for (int rep = 0; rep < reps; ++rep) {
    if (rep % 2 == 0) t_off.push_back(run_entry(e_off, en, true, run++).tokens_per_s);
    t_on.push_back(run_entry(e_on, en, true, run++).tokens_per_s);
    if (rep % 2 == 1) t_off.push_back(run_entry(e_off, en, true, run++).tokens_per_s);
  }
  const EngineStats after = e_on.stats();
  const double drafted = double(after.spec_draft_tokens - before.spec_draft_tokens),
               accepted = double(after.spec_accepted_tokens - before.spec_accepted_tokens);
  const double acceptance = drafted > 0 ? accepted / drafted : 0;
  const double a = median_of(t_off), b = median_of(t_on);
  std::printf(
      "%-16s speculation off %.1f tok/s, NGRAM K=%d %.1f tok/s: %.2fx; %.0f drafted tokens, "
      "%.1f%% accepted; %llu steps with drafting off (more than %d decoding)\n",
      en.name.c_str(), a, on.speculative_num_draft_tokens, b, b / a, drafted, 100 * acceptance,
      static_cast<unsigned long long>(after.spec_steps_off - before.spec_steps_off),
      on.speculative_disable_by_batch_size);
  std::fflush(stdout);
  return {{"name", en.name},
          {"requests", en.requests},
          {"prompt_len", en.prompt_len},
          {"tokens_per_s_speculation_off", a},
          {"tokens_per_s_speculation_on", b},
          {"tokens_per_s_speculation_off_all", t_off},
          {"tokens_per_s_speculation_on_all", t_on},
          {"speedup", b / a},
          {"num_draft_tokens", on.speculative_num_draft_tokens},
          {"draft_tokens", drafted},
          {"accepted_tokens", accepted},
          {"acceptance_rate", acceptance},
          {"steps_drafting_off", after.spec_steps_off - before.spec_steps_off}};
}

}  // namespace r3::cli
