#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace r3 {

using json = nlohmann::json;

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float TensorView::at(int64_t i) const {
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(data)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.f;
}

std::vector<float> TensorView::to_f32() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[size_t(i)] = at(i);
  return out;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

static constexpr uint64_t kMaxHeader = 100u << 20;

static DType parse_dtype(const std::string& s, const std::string& where) {
  if (s == "F32") return DType::F32;
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  throw Error(where + ": unsupported dtype \"" + s + "\" (r3 reads F32, BF16, F16)");
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw Error(path + ": cannot open safetensors file");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error(path + ": cannot stat");
  }
  map_size_ = size_t(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    throw Error(path + ": truncated file (" + std::to_string(map_size_) +
                " bytes, shorter than the 8-byte header length)");
  }
  map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw Error(path + ": mmap failed");
  }
  try {
    const uint8_t* base = static_cast<const uint8_t*>(map_);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(base[i]) << (8 * i);
    if (n > kMaxHeader) throw Error(path + ": header length " + std::to_string(n) +
                                    " exceeds the 100 MB limit");
    if (8 + n > map_size_)
      throw Error(path + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                  std::to_string(map_size_) + " bytes)");
    json header;
    try {
      header = json::parse(base + 8, base + 8 + n);
    } catch (const json::exception& e) {
      throw Error(path + ": malformed JSON header: " + e.what());
    }
    if (!header.is_object()) throw Error(path + ": header is not a JSON object");
    const uint8_t* buffer = base + 8 + n;
    const uint64_t buffer_size = map_size_ - 8 - n;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    std::vector<std::string> range_names;
    for (auto& [name, entry] : header.items()) {
      std::string where = path + ": tensor \"" + name + "\"";
      if (name == "__metadata__") {
        if (!entry.is_object()) throw Error(path + ": __metadata__ is not an object");
        for (auto& [k, v] : entry.items())
          if (v.is_string()) metadata_[k] = v.get<std::string>();
        continue;
      }
      if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
          !entry.contains("data_offsets"))
        throw Error(where + ": entry needs dtype, shape and data_offsets");
      if (!entry["dtype"].is_string()) throw Error(where + ": dtype is not a string");
      TensorView t;
      t.name = name;
      t.file = path;
      t.dtype = parse_dtype(entry["dtype"].get<std::string>(), where);
      if (!entry["shape"].is_array()) throw Error(where + ": shape is not an array");
      uint64_t total_bytes = dtype_size(t.dtype);
      bool too_large = false;
      for (auto& d : entry["shape"]) {
        if (!d.is_number_unsigned()) throw Error(where + ": shape holds a non-integer or negative");
        uint64_t du = d.get<uint64_t>();
        // numel() and nbytes() must not overflow (a wrapped product could pass the span check).
        if (du > uint64_t(INT64_MAX) || __builtin_mul_overflow(total_bytes, du, &total_bytes) ||
            total_bytes > uint64_t(INT64_MAX))
          too_large = true;
        t.shape.push_back(int64_t(du > uint64_t(INT64_MAX) ? INT64_MAX : du));
      }
      if (too_large) throw Error(where + ": shape " + entry["shape"].dump() + " is too large");
      auto& off = entry["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
          !off[1].is_number_unsigned())
        throw Error(where + ": data_offsets must be [begin, end]");
      uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
      if (b > e || e > buffer_size)
        throw Error(where + ": data offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                    ") out of range of the " + std::to_string(buffer_size) +
                    "-byte data buffer (truncated file?)");
      if (e - b != t.nbytes())
        throw Error(where + ": data offsets span " + std::to_string(e - b) + " bytes but shape " +
                    t.shape_str() + " of " + dtype_name(t.dtype) + " needs " +
                    std::to_string(t.nbytes()));
      t.data = buffer + b;
      ranges.push_back({b, e});
      range_names.push_back(name);
      tensors_[name] = std::move(t);
    }
    std::vector<size_t> order(ranges.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
    // Compare each range with the furthest-reaching non-empty one before it (an empty range
    // sorted in between must not hide an overlap).
    size_t reach = SIZE_MAX;
    for (size_t i = 0; i < order.size(); ++i) {
      auto& cur = ranges[order[i]];
      if (cur.first == cur.second) continue;
      if (reach != SIZE_MAX && cur.first < ranges[reach].second)
        throw Error(path + ": data offsets of tensors \"" + range_names[reach] + "\" and \"" +
                    range_names[order[i]] + "\" overlap");
      if (reach == SIZE_MAX || cur.second > ranges[reach].second) reach = order[i];
    }
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
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
  for (auto& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
  if (!out) throw Error(path + ": write failed");
}

}  // namespace r3
