// A block of routes: int16 [rows, layers, k], C order. The unit every part of r3 exchanges
// (engine output, transport, staging, replay).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace r3 {

struct RouteArray {
  int rows = 0, layers = 0, k = 0;
  int start = 0;                   // absolute position of row 0 (delta start N)
  std::vector<int> moe_layers;     // decoder-layer index of each column (may be empty)
  std::vector<int16_t> data;       // rows * layers * k

  RouteArray() = default;
  RouteArray(int r, int l, int kk, int16_t fill = -1)
      : rows(r), layers(l), k(kk), data(size_t(r) * size_t(l) * size_t(kk), fill) {}
  int16_t* row(int r) { return data.data() + size_t(r) * size_t(layers) * size_t(k); }
  const int16_t* row(int r) const { return data.data() + size_t(r) * size_t(layers) * size_t(k); }
  int16_t& at(int r, int l, int j) { return data[(size_t(r) * size_t(layers) + size_t(l)) * size_t(k) + size_t(j)]; }
  int16_t at(int r, int l, int j) const { return data[(size_t(r) * size_t(layers) + size_t(l)) * size_t(k) + size_t(j)]; }
};

// Base64 (RFC 4648, with padding). decode throws r3::Error on malformed input.
std::string base64_encode(const void* data, size_t n);
std::vector<uint8_t> base64_decode(const std::string& s);

// Transport (DESIGN.md): {"shape":[R,L,K],"dtype":"int16","start":N,"moe_layers":[...],
// "data":"<base64 of little-endian int16>"}.
nlohmann::json routes_to_json(const RouteArray& r);
RouteArray routes_from_json(const nlohmann::json& j);  // throws r3::Error naming the bad field

// .npy (format 1.0, '<i2', C order). `path` names the source in errors.
std::string npy_bytes(const RouteArray& r, const std::string& path = "<npy>");
void write_npy(const std::string& path, const RouteArray& r);
RouteArray read_npy(const std::string& path);  // accepts <i1, <i2, <i4 of rank 3
RouteArray parse_npy(const std::string& bytes, const std::string& path = "<npy>");

}  // namespace r3
