#include "bench_startup.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/seconds_since.h"

namespace r3::cli {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Reads every safetensors file of the checkpoint once, in 16 MiB pieces into one buffer: the
// floor for a start-up that must see every byte. Returns {seconds, bytes}.
std::pair<double, uint64_t> read_files_once(const std::string& dir) {
  std::vector<char> buf(size_t(16) << 20);
  uint64_t bytes = 0;
  const auto t0 = Clock::now();
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    std::ifstream in(e.path(), std::ios::binary);
    while (in.read(buf.data(), std::streamsize(buf.size())) || in.gcount() > 0)
      bytes += uint64_t(in.gcount());
  }
  return {seconds_since(t0), bytes};
}

// Maps `bytes` of fresh memory and writes one byte a page, a slice per thread, with the 2 MiB
// pages r3's big buffers ask for: the cheapest way found to have the kernel clear that much
// memory (on this kind of VM one thread with 4 KiB pages took 1.6-6x as long), which any loader
// that keeps it resident pays.
double first_touch(uint64_t bytes, int threads) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error("r3 bench startup: cannot map " + std::to_string(bytes) + " bytes");
  madvise(p, bytes, MADV_HUGEPAGE);  // a hint, as for r3's own buffers
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  const uint64_t slice = (bytes / uint64_t(threads) + page - 1) / page * page;
  const auto t0 = Clock::now();
  std::vector<std::thread> touching;
  for (int t = 0; t < threads; ++t)
    touching.emplace_back([=] {
      for (uint64_t at = uint64_t(t) * slice; at < std::min(bytes, uint64_t(t + 1) * slice);
           at += page)
        static_cast<volatile char*>(p)[at] = 1;
    });
  for (std::thread& t : touching) t.join();
  const double s = seconds_since(t0);
  munmap(p, bytes);
  return s;
}

double peak_resident_mb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

struct ChildFigures {
  double first_token_s, open_s, read_s, pack_s, build_s, peak_mb;
  uint64_t checkpoint_bytes, kv_bytes;
};

// A child builds the engine and generates one token; the parent reads its figures from a pipe.
ChildFigures run_child(const EngineConfig& cfg) {
  int fds[2];
  if (pipe(fds) != 0) throw Error("r3 bench startup: pipe failed");
  const pid_t pid = fork();
  if (pid < 0) throw Error("r3 bench startup: fork failed");
  if (pid == 0) {
    close(fds[0]);
    ChildFigures f{};
    int status = 0;
    try {
      const auto t0 = Clock::now();
      Engine e(cfg);
      SamplingParams p;
      p.max_tokens = 1;
      p.temperature = 0;
      (void)e.generate({{1, 2, 3}}, {p});
      f.first_token_s = seconds_since(t0);
      f.open_s = e.startup().open_seconds;
      f.read_s = e.startup().read_seconds;
      f.pack_s = e.startup().pack_seconds;
      f.build_s = e.startup().build_seconds;
      f.checkpoint_bytes = e.startup().checkpoint_bytes;
      f.kv_bytes = e.startup().kv_bytes;
      f.peak_mb = peak_resident_mb();
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "r3 bench startup: %s\n", ex.what());
      status = 1;
    }
    (void)!write(fds[1], &f, sizeof f);
    _exit(status);
  }
  close(fds[1]);
  ChildFigures f{};
  const ssize_t n = read(fds[0], &f, sizeof f);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (n != ssize_t(sizeof f) || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw Error("r3 bench startup: the engine could not start (see above)");
  return f;
}

}  // namespace

nlohmann::json bench_startup(const EngineConfig& cfg, int reps) {
  (void)read_files_once(cfg.model);  // into the page cache
  ChildFigures best{1e30, 1e30, 1e30, 1e30, 1e30, 0, 0, 0};
  double read_s = 1e30, touch_s = 1e30;
  const int threads = cfg.threads > 0 ? cfg.threads : int(std::thread::hardware_concurrency());
  uint64_t file_bytes = 0;
  for (int r = 0; r < reps; ++r) {
    const auto [s, bytes] = read_files_once(cfg.model);
    read_s = std::min(read_s, s);
    file_bytes = bytes;
    const ChildFigures f = run_child(cfg);
    best.first_token_s = std::min(best.first_token_s, f.first_token_s);
    best.open_s = std::min(best.open_s, f.open_s);
    best.read_s = std::min(best.read_s, f.read_s);
    best.pack_s = std::min(best.pack_s, f.pack_s);
    best.build_s = std::min(best.build_s, f.build_s);
    best.peak_mb = std::max(best.peak_mb, f.peak_mb);
    best.checkpoint_bytes = f.checkpoint_bytes;
    best.kv_bytes = f.kv_bytes;
    // In the state the child started from: the files in the page cache again (the child's load
    // gave back their pages as it packed them), so the touch too must reclaim them.
    (void)read_files_once(cfg.model);
    touch_s = std::min(touch_s, first_touch(uint64_t(f.peak_mb * 1024 * 1024), threads));
  }
  const double ckpt_mb = double(best.checkpoint_bytes) / double(1 << 20),
               kv_mb = double(best.kv_bytes) / double(1 << 20);
  std::printf(
      "startup        first token %.2f s (checkpoint %.2f s: read %.2f s, packed %.2f s; KV pool + "
      "runner "
      "%.2f s)\n",
      best.first_token_s, best.open_s, best.read_s, best.pack_s, best.build_s);
  std::printf(
      "  files once   %.2f GB from the page cache in %.2f s: first token = %.1fx that read\n",
      double(file_bytes) / 1e9, read_s, best.first_token_s / read_s);
  std::printf(
      "  first touch  %.0f MB (the peak resident) in %.2f s: first token = %.2fx (read + first "
      "touch)\n",
      best.peak_mb, touch_s, best.first_token_s / (read_s + touch_s));
  std::printf("  peak RSS     %.0f MB = %.2fx (checkpoint %.0f MB + KV pool %.0f MB)\n",
              best.peak_mb, best.peak_mb / (ckpt_mb + kv_mb), ckpt_mb, kv_mb);
  return {{"name", "startup"},
          {"first_token_s", best.first_token_s},
          {"open_s", best.open_s},
          {"read_s", best.read_s},
          {"pack_s", best.pack_s},
          {"build_s", best.build_s},
          {"read_files_s", read_s},
          {"file_bytes", file_bytes},
          {"first_touch_s", touch_s},
          {"first_token_over_read", best.first_token_s / read_s},
          {"first_token_over_read_and_touch", best.first_token_s / (read_s + touch_s)},
          {"peak_rss_mb", best.peak_mb},
          {"checkpoint_mb", ckpt_mb},
          {"kv_pool_mb", kv_mb},
          {"peak_over_checkpoint_and_kv", best.peak_mb / (ckpt_mb + kv_mb)}};
}

}  // namespace r3::cli
