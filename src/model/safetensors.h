// safetensors files: a reader that validates everything it is handed (the header at once, a
// tensor's bytes when they are read) and a writer. A file's tensors are read one at a time into
// memory the caller gives (Checkpoint packs them and drops them); bytes in memory are held whole.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets}}, then the data buffer (offsets relative to its start).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/file_read.h"
#include "core/tensor_view.h"
#include "core/thread_pool.h"

namespace r3 {

class SafetensorsFile {
 public:
  // Throws r3::Error naming the file (and tensor) for every malformed input, a path that is not
  // a regular file, and a read that outlasts kCheckpointReadLimit.
  // Parts of tensors to validate but not read (one rank of an expert-parallel group skips the
  // other ranks' experts): an empty vector skips the whole tensor (its data stays null);
  // otherwise rows[i] skips row i of its first dimension (those bytes are never touched, so
  // they take no memory).
  using UnreadParts = std::map<std::string, std::vector<bool>>;
  // Reads and checks the header only; the tensors' bytes are read by read_tensor (their views'
  // data stay null until the caller points them at what it read).
  explicit SafetensorsFile(const std::string& path, const UnreadParts* unread = nullptr);
  // The same reader over bytes in memory (a trainer's weights sent over HTTP); `name` names them
  // in errors.
  static std::unique_ptr<SafetensorsFile> from_bytes(std::string_view bytes,
                                                     const std::string& name);
  // The tensors (name, dtype, shape; no data) a safetensors file or body declares, read from its
  // first bytes with the reader's own checks; nullopt while `start` ends before its header does.
  static std::optional<std::vector<TensorView>> declared_tensors(std::string_view start,
                                                                 const std::string& name);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Whether `name`'s bytes are read on demand (a file) rather than held (bytes in memory).
  bool lazy() const { return file_ != nullptr; }
  // Which tensors read_tensor_direct reads past the page cache: those the page cache does not
  // mostly hold (copying from it is faster); where the kernel cannot say (before Linux 6.5), none
  // (IfUncached) or all (IfUncachedOrUnknown: files that cannot stay cached anyway); Always: even
  // cached ones (tests).
  enum class PastTheCache { IfUncached, IfUncachedOrUnknown, Always };
  // Reads tensor `name` whole past the page cache into area (4 KiB-aligned, direct_bytes(name)
  // long; RegularFile::read_direct) and returns where its bytes begin there; null when `when`
  // says to read it through the page cache, rows of it are left unread, it starts off an 8-byte
  // boundary, or the file system refuses direct reads: read_tensor then.
  const uint8_t* read_tensor_direct(const std::string& name, uint8_t* area,
                                    PastTheCache when) const;
  size_t direct_bytes(const std::string& name) const;
  // Reads tensor `name`'s bytes into dst (nbytes of them; rows UnreadParts skips stay
  // untouched). Throws r3::Error naming the file when it ends early or the read fails. With a
  // pool, a whole tensor's 64 MiB pieces are read on its threads at once: a large embedding's
  // read is mostly the kernel clearing its fresh destination pages, which one core does slowly.
  void read_tensor(const std::string& name, uint8_t* dst, ThreadPool* pool = nullptr) const;
  // The reverse: `name`'s bytes may leave the page cache (RegularFile::dont_need).
  void drop_cached(const std::string& name) const;
  // Whether UnreadParts skips all of `name` (its data stays null).
  bool never_read(const std::string& name) const {
    auto it = unread_copy_.find(name);
    return it != unread_copy_.end() && it->second.empty();
  }
  // The file's identity when it was opened (device, inode, size, modification time): a later
  // reader checks the same bytes are still there.
  struct Identity {
    uint64_t device = 0, inode = 0, size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const Identity&) const = default;
  };
  const Identity& identity() const { return identity_; }
  static Identity identity_of(const std::string& path);
  // Closes the file (no tensor can be read afterwards).
  void close() { file_.reset(); }

 private:
  SafetensorsFile() = default;
  // Checks the header; bytes in memory (no file_) are copied in now, a file's are read later
  // (read_tensor).
  void parse(uint64_t size, const std::function<void(uint64_t, void*, size_t)>& read_at);
  struct AlignedFree {
    void operator()(uint8_t* p) const;
  };
  std::string path_;
  std::unique_ptr<RegularFile> file_;  // a file's, until close()
  Identity identity_;
  uint64_t data_start_ = 0;                     // where the data buffer starts in the file
  std::map<std::string, uint64_t> offsets_;     // each tensor's first byte in the data buffer
  UnreadParts unread_copy_;                     // the constructor's
  std::unique_ptr<uint8_t, AlignedFree> data_;  // every tensor, each at a 64-byte aligned offset
  uint64_t owned_bytes_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little-endian, C order
};

// A copy of a tensor's bytes under its name (what a trainer sends, what the writer takes).
TensorToWrite copy_tensor(const TensorView& t);
// A view of t's bytes (valid while t lives).
TensorView view_of(const TensorToWrite& t);
// Every tensor of a safetensors file with its bytes, in name order.
std::vector<TensorToWrite> read_safetensors(const std::string& path);

// Writes tensors in the given order, header padded to 8 bytes as Hugging Face does.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace r3
