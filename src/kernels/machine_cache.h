// Choices timed on the machine once per CPU model and kept in a small JSON file
// ($XDG_CACHE_HOME/r3/<name>.json, or ~/.cache/r3/<name>.json), so later processes start
// without timing again.
#pragma once
#include <optional>
#include <string>

namespace r3::kernels {

// The CPU model as /proc/cpuinfo names it, with the kernel set: what the timings depend on.
std::string cpu_key();
// The cache file for `name` ("tiles", "attention").
std::string machine_cache_file(const std::string& name);
// The value cached under key (a damaged or missing file: nothing).
std::optional<std::string> read_machine_cache(const std::string& file, const std::string& key);
// Stores it (an unwritable file: nothing is kept, and the next process times again).
void write_machine_cache(const std::string& file, const std::string& key, const std::string& value);

}  // namespace r3::kernels
