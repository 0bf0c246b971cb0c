// safetensors files: a reader that validates everything it is handed and copies the tensors into
// memory it owns, and a writer.
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets}}, then the data buffer (offsets relative to its start).
#pragma once
#include <cstdint>
#include <functional>
#include <string_view>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor_view.h"

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
  explicit SafetensorsFile(const std::string& path, const UnreadParts* unread = nullptr);
  // The same reader over bytes in memory (a trainer's weights sent over HTTP); `name` names them
  // in errors.
  static std::unique_ptr<SafetensorsFile> from_bytes(std::string_view bytes, const std::string& name);
  // The tensors (name, dtype, shape; no data) a safetensors file or body declares, read from its
  // first bytes with the reader's own checks; nullopt while `start` ends before its header does.
  static std::optional<std::vector<TensorView>> declared_tensors(std::string_view start, const std::string& name);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void parse(uint64_t size, const std::function<void(uint64_t, void*, size_t)>& read_at,
             const UnreadParts* unread = nullptr);
  struct AlignedFree {
    void operator()(uint8_t* p) const;
  };
  std::string path_;
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

// Writes tensors in the given order, header padded to 8 bytes as Hugging Face does.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace r3
