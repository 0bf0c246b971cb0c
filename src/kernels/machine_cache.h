// Choices timed on the machine once per CPU model and kept in a small JSON file
// ($XDG_CACHE_HOME/r3/<name>.json, or ~/.cache/r3/<name>.json), so later processes start
// without timing again.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace r3::kernels {

// The CPU model as /proc/cpuinfo names it, with the kernel set: what the timings depend on.
std::string cpu_key();
// The cache file for `name` ("tiles", "decode_attention").
std::string machine_cache_file(const std::string& name);
// The value cached under key (a damaged or missing file: nothing).
std::optional<std::string> read_machine_cache(const std::string& file, const std::string& key);
// Stores it (an unwritable file: nothing is kept, and the next process times again).
void write_machine_cache(const std::string& file, const std::string& key, const std::string& value);

// A choice among same-bits variants by name: `forced` (the value of the environment variable
// `env`) when set, a name outside `names` being an r3::Error; else the name cached for this CPU
// model in cache_file; else the one time() picks, then cached. source: `env`, "cached for <cpu>"
// or "timed on <cpu>".
struct MachineChoice {
  std::string name, source;
};
MachineChoice choose_on_machine(const std::string& cache_file, const char* env, const char* forced,
                                const std::vector<std::string>& names,
                                const std::function<std::string()>& time);

}  // namespace r3::kernels
