#include "model/safetensors.h"

#include <sys/stat.h>
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file_read.h"
#include "core/json_limits.h"

namespace r3 {

using json = nlohmann::json;

static constexpr uint64_t kMaxHeader = 100u << 20;
static constexpr uint64_t kMaxFile = uint64_t(1) << 42;  // 4 TiB: past any checkpoint shard

static DType parse_dtype(const std::string& s, const std::string& where) {
  if (s == "F32") return DType::F32;
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  if (s == "U8") return DType::U8;
  if (s == "F8_E4M3") return DType::F8_E4M3;
  throw Error(where + ": unsupported dtype \"" + s +
              "\" (r3 reads F32, BF16, F16, U8 for MXFP4 blocks and scales, and F8_E4M3 "
              "block-scaled weights)");
}

static uint64_t round_up64(uint64_t n) { return (n + 63) & ~uint64_t(63); }

// The header length the first 8 bytes give, within the limit.
static uint64_t header_length(const uint8_t len[8], const std::string& path) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  if (n > kMaxHeader)
    throw Error(path + ": header length " + std::to_string(n) + " exceeds the 100 MB limit");
  return n;
}

// The header's JSON object: begins with '{', ends with '}' and spaces only, nesting bounded.
static json parse_header(std::string_view text, const std::string& path) {
  if (text.empty() || text[0] != '{')
    throw Error(
        path + ": the header must begin with '{' (found " +
        (text.empty() ? std::string("nothing") : "byte " + std::to_string(uint8_t(text[0]))) + ")");
  size_t json_end = text.size();
  while (json_end > 0 && text[json_end - 1] == ' ') --json_end;  // the only padding allowed
  if (text[json_end - 1] != '}')
    throw Error(path +
                ": malformed JSON header: the object must end with '}' followed only by spaces");
  json header;
  try {
    header = parse_json_bounded(text.substr(0, json_end), path + ": header", 8);
  } catch (const json::exception& e) {
    throw Error(path + ": malformed JSON header: " + e.what());
  }
  if (!header.is_object()) throw Error(path + ": header is not a JSON object");
  return header;
}

// A tensor entry's name, dtype and shape (its data offsets are the caller's): exactly dtype,
// shape and data_offsets, a dtype r3 reads, a shape whose byte count cannot overflow.
static TensorView entry_view(const std::string& name, const json& entry, const std::string& path) {
  const std::string where = path + ": tensor \"" + name + "\"";
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
      !entry.contains("data_offsets") || entry.size() != 3)
    throw Error(where + ": entry must hold exactly dtype, shape and data_offsets");
  if (!entry["dtype"].is_string()) throw Error(where + ": dtype is not a string");
  TensorView t;
  t.name = name;
  t.file = path;
  t.dtype = parse_dtype(entry["dtype"].get<std::string>(), where);
  if (!entry["shape"].is_array()) throw Error(where + ": shape is not an array");
  uint64_t total_bytes = dtype_size(t.dtype);
  for (auto& d : entry["shape"]) {
    if (!d.is_number_unsigned()) throw Error(where + ": shape holds a non-integer or negative");
    const uint64_t du = d.get<uint64_t>();
    // numel() and nbytes() must not overflow (a wrapped product could pass the span check).
    if (du > uint64_t(INT64_MAX) || __builtin_mul_overflow(total_bytes, du, &total_bytes) ||
        total_bytes > uint64_t(INT64_MAX))
      throw Error(where + ": shape " + entry["shape"].dump() + " is too large");
    t.shape.push_back(int64_t(du));
  }
  return t;
}

void SafetensorsFile::AlignedFree::operator()(uint8_t* p) const {
  ::operator delete(p, std::align_val_t(64));
}

// The format, strictly (huggingface/safetensors): u64 little-endian N; N bytes of a JSON object
// that begins with '{' and may be padded at the end with spaces (0x20) only; then the data
// buffer, which the tensors' [begin, end) offsets must tile exactly: sorted, contiguous, from 0
// to the buffer's end. A file's tensors are read when asked for (read_tensor) into memory the
// reader's caller owns, so nothing done to the file afterwards reaches a running engine.
SafetensorsFile::SafetensorsFile(const std::string& path, const UnreadParts* unread) : path_(path) {
  file_ = std::make_unique<RegularFile>(path, kMaxFile, "safetensors file");
  identity_ = identity_of(path);
  if (unread) unread_copy_ = *unread;
  const auto deadline = std::chrono::steady_clock::now() + kCheckpointReadLimit;
  parse(file_->size(),
        [&](uint64_t offset, void* dst, size_t n) { file_->read_at(offset, dst, n, deadline); });
}

SafetensorsFile::Identity SafetensorsFile::identity_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error(path + ": cannot stat: " + std::strerror(errno));
  return {uint64_t(st.st_dev), uint64_t(st.st_ino), uint64_t(st.st_size),
          int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

size_t SafetensorsFile::direct_bytes(const std::string& name) const {
  return RegularFile::direct_span(data_start_ + offsets_.at(name), tensors_.at(name).nbytes());
}

const uint8_t* SafetensorsFile::read_tensor_direct(const std::string& name, uint8_t* area,
                                                   PastTheCache when) const {
  if (!file_ || unread_copy_.count(name)) return nullptr;
  const uint64_t begin = data_start_ + offsets_.at(name), bytes = tensors_.at(name).nbytes();
  if (begin % 8) return nullptr;  // its elements would land unaligned (a header not padded to 8)
  if (when != PastTheCache::Always) {
    const std::optional<bool> cached = file_->mostly_cached(begin, bytes);
    if (cached ? *cached : when == PastTheCache::IfUncached) return nullptr;
  }
  return file_->read_direct(begin, size_t(bytes), area,
                            std::chrono::steady_clock::now() + kCheckpointReadLimit);
}

void SafetensorsFile::read_tensor(const std::string& name, uint8_t* dst, ThreadPool* pool) const {
  if (!file_) throw Error(path_ + ": tensor \"" + name + "\" read after the file was closed");
  const TensorView& t = tensors_.at(name);
  const uint64_t begin = data_start_ + offsets_.at(name), bytes = t.nbytes();
  const auto deadline = std::chrono::steady_clock::now() + kCheckpointReadLimit;
  const std::vector<bool>* skip = nullptr;
  if (auto it = unread_copy_.find(name); it != unread_copy_.end()) skip = &it->second;
  if (skip && skip->empty()) return;  // not read at all
  if (!skip) {
    // 64 MiB at a time, so one large tensor's read keeps checking its deadline.
    constexpr uint64_t kPiece = uint64_t(64) << 20;
    auto piece = [&](int64_t i) {
      const uint64_t at = uint64_t(i) * kPiece;
      file_->read_at(begin + at, dst + at, size_t(std::min(kPiece, bytes - at)), deadline);
    };
    const int64_t pieces = int64_t((bytes + kPiece - 1) / kPiece);
    if (pool)
      pool->parallel_for_each(pieces, piece);  // a piece's error is rethrown here
    else
      for (int64_t i = 0; i < pieces; ++i) piece(i);
    return;
  }
  // Row by row of the first dimension, runs of read rows at once.
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  if (int64_t(skip->size()) != rows)
    throw Error(path_ + ": tensor \"" + name + "\": " + std::to_string(skip->size()) +
                " row marks for " + std::to_string(rows) + " rows");
  const uint64_t row_bytes = rows ? bytes / uint64_t(rows) : 0;
  for (int64_t r = 0; r < rows;) {
    if ((*skip)[size_t(r)]) {
      ++r;
      continue;
    }
    int64_t e = r;
    while (e < rows && !(*skip)[size_t(e)]) ++e;
    file_->read_at(begin + uint64_t(r) * row_bytes, dst + uint64_t(r) * row_bytes,
                   size_t(uint64_t(e - r) * row_bytes), deadline);
    r = e;
  }
}

void SafetensorsFile::drop_cached(const std::string& name) const {
  if (!file_ || never_read(name)) return;
  file_->dont_need(data_start_ + offsets_.at(name), tensors_.at(name).nbytes());
}

std::optional<std::vector<TensorView>> SafetensorsFile::declared_tensors(std::string_view start,
                                                                         const std::string& name) {
  if (start.size() < 8) return std::nullopt;
  const uint64_t n = header_length(reinterpret_cast<const uint8_t*>(start.data()), name);
  if (start.size() - 8 < n) return std::nullopt;
  const json header = parse_header(start.substr(8, size_t(n)), name);  // outlives its items() below
  std::vector<TensorView> out;
  for (auto& [tensor, entry] : header.items())
    if (tensor != "__metadata__") out.push_back(entry_view(tensor, entry, name));
  return out;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::from_bytes(std::string_view bytes,
                                                             const std::string& name) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = name;
  f->parse(bytes.size(), [&](uint64_t offset, void* dst, size_t n) {
    if (offset > bytes.size() || n > bytes.size() - offset)
      throw Error(name + ": read past the end");
    std::memcpy(dst, bytes.data() + offset, n);
  });
  return f;
}

void SafetensorsFile::parse(uint64_t file_size,
                            const std::function<void(uint64_t, void*, size_t)>& read_at) {
  const std::string& path = path_;
  if (file_size < 8)
    throw Error(path + ": truncated file (" + std::to_string(file_size) +
                " bytes, shorter than the 8-byte header length)");
  uint8_t len[8];
  read_at(0, len, 8);
  const uint64_t n = header_length(len, path);
  if (n > file_size - 8)
    throw Error(path + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                std::to_string(file_size) + " bytes)");
  std::string text(size_t(n), '\0');
  read_at(8, text.data(), text.size());
  const json header = parse_header(text, path);
  const uint64_t buffer_size = file_size - 8 - n;

  struct Entry {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Entry> entries;
  for (auto& [name, entry] : header.items()) {
    std::string where = path + ": tensor \"" + name + "\"";
    if (name == "__metadata__") {
      if (!entry.is_object()) throw Error(path + ": __metadata__ is not an object");
      for (auto& [k, v] : entry.items()) {
        if (!v.is_string())
          throw Error(path + ": __metadata__ value of \"" + k + "\" is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    TensorView t = entry_view(name, entry, path);
    auto& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      throw Error(where + ": data_offsets must be [begin, end]");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > buffer_size)
      throw Error(where + ": data offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                  ") out of range of the " + std::to_string(buffer_size) +
                  "-byte data buffer (truncated file or wrong header length?)");
    if (e - b != t.nbytes())
      throw Error(where + ": data offsets span " + std::to_string(e - b) + " bytes but shape " +
                  t.shape_str() + " of " + dtype_name(t.dtype) + " needs " +
                  std::to_string(t.nbytes()));
    entries.push_back({b, e, name});
    offsets_[name] = b;
    tensors_[name] = std::move(t);
  }
  // The offsets must tile the data buffer: no gap, no overlap, nothing after the last tensor.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  for (const Entry& en : entries) {
    if (en.begin != covered)
      throw Error(path + ": tensor \"" + en.name + "\" starts at byte " + std::to_string(en.begin) +
                  " of the data buffer, expected " + std::to_string(covered) +
                  (en.begin < covered ? " (overlaps the tensor before it)" : " (a gap before it)"));
    covered = en.end;
  }
  if (covered != buffer_size)
    throw Error(path + ": the tensors cover " + std::to_string(covered) + " bytes of the " +
                std::to_string(buffer_size) +
                "-byte data buffer (wrong header length or trailing bytes)");
  data_start_ = 8 + n;
  if (file_) return;  // a file: tensors are read when asked for (read_tensor)

  // Copy every tensor into owned, 64-byte aligned memory (each tensor at an aligned offset, so
  // bytes that pack tensors at odd offsets are read without misaligned access).
  uint64_t owned = 0;
  for (const Entry& en : entries) owned += round_up64(en.end - en.begin);
  data_.reset(static_cast<uint8_t*>(
      ::operator new(size_t(std::max<uint64_t>(owned, 64)), std::align_val_t(64))));
  uint64_t at = 0;
  for (const Entry& en : entries) {
    read_at(8 + n + en.begin, data_.get() + at, size_t(en.end - en.begin));
    tensors_[en.name].data = data_.get() + at;
    at += round_up64(en.end - en.begin);
  }
  owned_bytes_ = owned;
}

SafetensorsFile::~SafetensorsFile() = default;

TensorToWrite copy_tensor(const TensorView& t) {
  TensorToWrite w{t.name, t.dtype, t.shape, {}};
  w.bytes.assign(static_cast<const uint8_t*>(t.data),
                 static_cast<const uint8_t*>(t.data) + t.nbytes());
  return w;
}

TensorView view_of(const TensorToWrite& t) {
  TensorView v;
  v.name = t.name;
  v.dtype = t.dtype;
  v.shape = t.shape;
  v.data = t.bytes.data();
  return v;
}

std::vector<TensorToWrite> read_safetensors(const std::string& path) {
  SafetensorsFile f(path);
  std::vector<TensorToWrite> out;
  for (const auto& [name, t] : f.tensors()) {
    out.push_back({name, t.dtype, t.shape, std::vector<uint8_t>(t.nbytes())});
    f.read_tensor(name, out.back().bytes.data());
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (t.bytes.size() != size_t(numel) * dtype_size(t.dtype))
      throw Error("write_safetensors: tensor \"" + t.name + "\" has " +
                  std::to_string(t.bytes.size()) + " bytes, shape needs " +
                  std::to_string(size_t(numel) * dtype_size(t.dtype)));
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8) h.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(path + ": cannot open for writing");
  uint64_t n = h.size();
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(h.data(), std::streamsize(h.size()));
  for (auto& t : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
  if (!out) throw Error(path + ": write failed");
}

}  // namespace r3
