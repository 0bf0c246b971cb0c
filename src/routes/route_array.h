// A block of routes: int16 [rows, layers, k], C order (on the wire as narrow as the expert count
// allows). The unit every part of r3 exchanges (engine output, transport, staging, replay).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace r3 {

struct RouteArray {
  int rows = 0, layers = 0, k = 0;
  int start = 0;                // absolute position of row 0 (delta start N)
  std::vector<int> moe_layers;  // decoder-layer index of each column (may be empty)
  int num_experts = 0;          // the model's expert count, when known (sizes the wire id type)
  std::vector<int16_t> data;    // rows * layers * k
  // The gate weight of each chosen expert, in the ids' layout (rows * layers * k), as the MoE
  // block combined the experts with (router.h): empty unless the request asked for them
  // (return_routed_expert_weights).
  std::vector<float> weights;

  RouteArray() = default;
  RouteArray(int r, int l, int kk, int16_t fill = -1)
      : rows(r), layers(l), k(kk), data(size_t(r) * size_t(l) * size_t(kk), fill) {}
  int16_t* row(int r) { return data.data() + size_t(r) * size_t(layers) * size_t(k); }
  const int16_t* row(int r) const { return data.data() + size_t(r) * size_t(layers) * size_t(k); }
  int16_t& at(int r, int l, int j) {
    return data[(size_t(r) * size_t(layers) + size_t(l)) * size_t(k) + size_t(j)];
  }
  int16_t at(int r, int l, int j) const {
    return data[(size_t(r) * size_t(layers) + size_t(l)) * size_t(k) + size_t(j)];
  }
  bool has_weights() const { return !weights.empty(); }
  // Rows of `more` (the next rows, same layout) after these; weights only when both have them.
  void append(const RouteArray& more);
};

// Base64 (RFC 4648, with padding). decode throws r3::Error on malformed input.
std::string base64_encode(const void* data, size_t n);
std::vector<uint8_t> base64_decode(const std::string& s);

// The narrowest integer type a payload of r's ids is written in, always named in the payload:
// int8 when every id fits [-1, 127], uint8 when they fit [0, 255] (no -1: a missing row), else
// int16. By the model's expert count when r knows it (so every reply of a model has one type:
// 128 experts int8, 256 uint8, 512 int16), else by the ids present. A uint8 payload could not
// overflow silently the way prime-rl #3051's did: past 256 experts the type widens.
enum class RouteIdType { Int8, Uint8, Int16 };
RouteIdType route_id_type(const RouteArray& r);
const char* route_id_type_name(RouteIdType t);  // "int8" | "uint8" | "int16"

// Transport (DESIGN.md): {"shape":[R,L,K],"dtype":"int8"|"uint8"|"int16","start":N,
// "moe_layers":[...],"data":"<base64 of the little-endian ids>"} (dtype by route_id_type).
nlohmann::json routes_to_json(const RouteArray& r);
RouteArray routes_from_json(const nlohmann::json& j);  // throws r3::Error naming the bad field

// The weights as their own transport object: {"shape":[R,L,K],"dtype":"float32","start":N,
// "moe_layers":[...],"data":"<base64 of the little-endian float32 weights>"}.
nlohmann::json route_weights_to_json(const RouteArray& r);
// The inverse: the weights of such an object (throws r3::Error naming the bad field).
std::vector<float> route_weights_from_json(const nlohmann::json& j);
// Little-endian float32 bytes of a weights array, and back (throws on a length not 4n).
std::string float32_bytes(const std::vector<float>& w);
std::vector<float> floats_of_bytes(const std::vector<uint8_t>& bytes);

// .npy (format 1.0, C order; '|i1', '|u1' or '<i2' by route_id_type). `path` names the source
// in errors.
std::string npy_bytes(const RouteArray& r, const std::string& path = "<npy>");
void write_npy(const std::string& path, const RouteArray& r);
RouteArray read_npy(const std::string& path);  // accepts i1, u1, <i2, <i4 of rank 3
RouteArray parse_npy(const std::string& bytes, const std::string& path = "<npy>");
// The weights of r as a float32 ('<f4') .npy of r's shape.
std::string npy_weight_bytes(const RouteArray& r);

}  // namespace r3
