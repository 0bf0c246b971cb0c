#include "kernels/machine_cache.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "core/error.h"
#include "kernels/kernel_set.h"

namespace r3::kernels {

namespace {
nlohmann::json read_all(const std::string& file) {
  try {
    std::ifstream in(file);
    if (!in) return nlohmann::json::object();
    nlohmann::json j = nlohmann::json::parse(in);
    return j.is_object() ? j : nlohmann::json::object();
  } catch (const nlohmann::json::exception&) {
    return nlohmann::json::object();  // a damaged cache is timed again and rewritten
  }
}
}  // namespace

std::string cpu_key() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return model + " / " + active_kernels().name;
}

std::string machine_cache_file(const std::string& name) {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string dir = xdg && *xdg ? std::string(xdg) + "/r3"
                                      : std::string(home && *home ? home : "/tmp") + "/.cache/r3";
  return dir + "/" + name + ".json";
}

std::optional<std::string> read_machine_cache(const std::string& file, const std::string& key) {
  const nlohmann::json j = read_all(file);
  if (j.contains(key) && j[key].is_string()) return j[key].get<std::string>();
  return std::nullopt;
}

void write_machine_cache(const std::string& file, const std::string& key,
                         const std::string& value) {
  nlohmann::json j = read_all(file);
  j[key] = value;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(file).parent_path(), ec);
  // Written beside and renamed over: processes starting at once (expert-parallel ranks, test
  // shards) never read a half-written file.
  const std::string tmp = file + ".tmp." + std::to_string(::getpid());
  std::ofstream(tmp) << j.dump(2) << "\n";
  std::filesystem::rename(tmp, file, ec);
  if (ec) std::filesystem::remove(tmp, ec);
}

MachineChoice choose_on_machine(const std::string& cache_file, const char* env, const char* forced,
                                const std::vector<std::string>& names,
                                const std::function<std::string()>& time) {
  auto known = [&](const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  if (forced && *forced) {
    if (!known(forced)) {
      std::string all;
      for (const std::string& n : names) all += (all.empty() ? "" : " or ") + n;
      throw Error(std::string(env) + "=" + forced + ": must be " + all);
    }
    return {forced, env};
  }
  const std::string key = cpu_key();
  if (const std::optional<std::string> cached = read_machine_cache(cache_file, key);
      cached && known(*cached))
    return {*cached, "cached for " + key};
  MachineChoice c{time(), "timed on " + key};
  write_machine_cache(cache_file, key, c.name);
  return c;
}

}  // namespace r3::kernels
