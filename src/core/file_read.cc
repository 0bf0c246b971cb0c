#include "core/file_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace r3 {

RegularFile::RegularFile(const std::string& path, uint64_t max_bytes, const char* what)
    : path_(path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) throw Error(path + ": cannot open " + what + " (" + std::strerror(errno) + ")");
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    throw Error(path + ": cannot stat " + what);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw Error(path + ": " + what + " is not a regular file");
  }
  size_ = uint64_t(st.st_size);
  if (size_ > max_bytes) {
    ::close(fd_);
    throw Error(path + ": " + what + " is " + std::to_string(size_) + " bytes, over the limit of " +
                std::to_string(max_bytes));
  }
  // Regular files ignore O_NONBLOCK for reads; clear it anyway so a read never returns EAGAIN.
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

const uint8_t* RegularFile::read_direct(uint64_t offset, size_t n, uint8_t* dst,
                                        std::chrono::steady_clock::time_point deadline) const {
  // /proc/self/fd/N opens the inode this descriptor holds, even if the path now names another file.
  const std::string self = "/proc/self/fd/" + std::to_string(fd_);
  const int fd = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const uint64_t begin = offset / kDirectAlign * kDirectAlign, want = offset + n;
  uint64_t at = begin;
  constexpr size_t kChunk = size_t(64) << 20;  // the deadline is checked between chunks
  while (at < want) {
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(path_ + ": reading took longer than the time limit (a stalled file system?)");
    const size_t ask = size_t(
        std::min<uint64_t>(kChunk, (want - at + kDirectAlign - 1) / kDirectAlign * kDirectAlign));
    const ssize_t got = ::pread(fd, dst + (at - begin), ask, off_t(at));
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL && at == begin) return nullptr;  // direct reads refused here
      throw Error(path_ + ": read failed (" + std::strerror(errno) + ")");
    }
    if (got == 0) throw Error(path_ + ": the file ended early (truncated while being read?)");
    at += uint64_t(got);
  }
  return dst + (offset - begin);
}

std::optional<bool> RegularFile::mostly_cached(uint64_t offset, uint64_t n) const {
  // cachestat is number 451 on every architecture (Linux 6.5); older kernels answer ENOSYS.
  constexpr long kCachestat = 451;
  struct {
    uint64_t off, len;
  } range{offset, n};
  struct {
    uint64_t cache, dirty, writeback, evicted, recently_evicted;
  } stat{};
  if (::syscall(kCachestat, fd_, &range, &stat, 0) != 0) return std::nullopt;
  return stat.cache * uint64_t(sysconf(_SC_PAGESIZE)) * 2 >= n;
}

void RegularFile::dont_need(uint64_t offset, uint64_t n) const {
  (void)posix_fadvise(fd_, off_t(offset), off_t(n), POSIX_FADV_DONTNEED);
}

void RegularFile::read_at(uint64_t offset, void* dst, size_t n,
                          std::chrono::steady_clock::time_point deadline) const {
  char* out = static_cast<char*>(dst);
  constexpr size_t kChunk = size_t(64) << 20;  // the deadline is checked between chunks
  while (n > 0) {
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(path_ + ": reading took longer than the time limit (a stalled file system?)");
    const ssize_t got = ::pread(fd_, out, std::min(n, kChunk), off_t(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(path_ + ": read failed (" + std::strerror(errno) + ")");
    }
    if (got == 0) throw Error(path_ + ": the file ended early (truncated while being read?)");
    out += got;
    offset += uint64_t(got);
    n -= size_t(got);
  }
}

std::string read_text_file(const std::string& path, uint64_t max_bytes, const char* what) {
  RegularFile f(path, max_bytes, what);
  std::string s(size_t(f.size()), '\0');
  f.read_at(0, s.data(), s.size(), std::chrono::steady_clock::now() + kCheckpointReadLimit);
  return s;
}

}  // namespace r3
