// Reading files that a user or a trainer hands r3 (config.json, safetensors shards): only
// regular files (a FIFO or a device would block or never end), never more than a stated limit,
// and never longer than a deadline, so a bad path gives a clear error instead of a hang.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace r3 {

// An open regular file. Throws r3::Error naming the path when it cannot be opened, is not a
// regular file, or is larger than max_bytes.
class RegularFile {
 public:
  RegularFile(const std::string& path, uint64_t max_bytes, const char* what);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;

  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Reads exactly n bytes at offset into dst; throws if the file ends first (it shrank), on an
  // I/O error, or when the deadline passes.
  void read_at(uint64_t offset, void* dst, size_t n,
               std::chrono::steady_clock::time_point deadline) const;
  // Reads [offset, offset + n) past the page cache (O_DIRECT, through a second descriptor of
  // this same file, not its path): the disk writes into dst, with no page-cache pages to fill,
  // copy from and free. dst is kDirectAlign-aligned with room for direct_span(offset, n) bytes;
  // returns where the range begins in dst, or null when the file system refuses direct reads
  // (read_at then). Throws like read_at.
  static constexpr size_t kDirectAlign = 4096;
  static size_t direct_span(uint64_t offset, size_t n) {
    return (size_t(offset % kDirectAlign) + n + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  }
  const uint8_t* read_direct(uint64_t offset, size_t n, uint8_t* dst,
                             std::chrono::steady_clock::time_point deadline) const;
  // Whether at least half of [offset, offset + n) is in the page cache (cachestat(2)); nullopt
  // where the kernel cannot say (before Linux 6.5).
  std::optional<bool> mostly_cached(uint64_t offset, uint64_t n) const;
  // Tells the kernel [offset, offset + n) will not be read again, so its page cache may go
  // (posix_fadvise DONTNEED; advice only).
  void dont_need(uint64_t offset, uint64_t n) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// A whole small file (config.json, an index) as text.
std::string read_text_file(const std::string& path, uint64_t max_bytes, const char* what);

// How long reading one checkpoint may take before it is abandoned (a stalled network mount).
constexpr std::chrono::seconds kCheckpointReadLimit{600};

}  // namespace r3
