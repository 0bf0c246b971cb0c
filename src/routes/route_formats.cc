#include "routes/route_formats.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace r3 {

RouteFormat parse_route_format(const std::string& name) {
  if (name == "r3") return RouteFormat::R3;
  if (name == "sglang") return RouteFormat::Sglang;
  if (name == "vllm") return RouteFormat::Vllm;
  if (name == "nrlre1") return RouteFormat::Nrlre1;
  throw Error("routed_experts_format must be r3, sglang, vllm or nrlre1, got \"" + name + "\"");
}

const char* route_format_name(RouteFormat f) {
  switch (f) {
    case RouteFormat::R3:
      return "r3";
    case RouteFormat::Sglang:
      return "sglang";
    case RouteFormat::Vllm:
      return "vllm";
    case RouteFormat::Nrlre1:
      return "nrlre1";
  }
  return "?";
}

namespace {
// base64 of little-endian 32-bit words [rows, num_hidden_layers, K]: word_of(i) for the element
// i of r's MoE columns, 0 for a dense layer's.
template <class WordOf>
std::string encode_sglang_layout(const RouteArray& r, int num_hidden_layers, WordOf word_of) {
  if (int(r.moe_layers.size()) != r.layers)
    throw Error("encode_sglang_routes: the routes do not name their decoder layers");
  std::vector<uint8_t> out(size_t(r.rows) * size_t(num_hidden_layers) * size_t(r.k) * 4, 0);
  for (int row = 0; row < r.rows; ++row)
    for (int l = 0; l < r.layers; ++l) {
      const int layer = r.moe_layers[size_t(l)];
      if (layer < 0 || layer >= num_hidden_layers)
        throw Error("encode_sglang_routes: layer id out of range");
      for (int j = 0; j < r.k; ++j) {
        const uint32_t v =
            word_of((size_t(row) * size_t(r.layers) + size_t(l)) * size_t(r.k) + size_t(j));
        uint8_t* d =
            out.data() +
            ((size_t(row) * size_t(num_hidden_layers) + size_t(layer)) * size_t(r.k) + size_t(j)) *
                4;
        for (int b = 0; b < 4; ++b) d[b] = uint8_t(v >> (8 * b));  // little-endian
      }
    }
  return base64_encode(out.data(), out.size());
}
}  // namespace

std::string encode_sglang_routes(const RouteArray& r, int num_hidden_layers) {
  return encode_sglang_layout(r, num_hidden_layers,
                              [&](size_t i) { return uint32_t(int32_t(r.data[i])); });
}

std::string encode_sglang_route_weights(const RouteArray& r, int num_hidden_layers) {
  if (r.weights.size() != r.data.size())
    throw Error("encode_sglang_route_weights: the routes carry no weights");
  return encode_sglang_layout(r, num_hidden_layers, [&](size_t i) {
    uint32_t u;
    std::memcpy(&u, &r.weights[i], 4);
    return u;
  });
}

RouteArray decode_sglang_routes(const std::string& b64, int num_hidden_layers, int k,
                                const std::vector<int>& moe_layers, int start) {
  const std::vector<uint8_t> bytes = base64_decode(b64);
  const size_t per_row = size_t(num_hidden_layers) * size_t(k) * 4;
  if (per_row == 0 || bytes.size() % per_row)
    throw Error("sglang routes: " + std::to_string(bytes.size()) +
                " bytes are not whole rows of [" + std::to_string(num_hidden_layers) + ", " +
                std::to_string(k) + "] int32");
  RouteArray r(int(bytes.size() / per_row), int(moe_layers.size()), k);
  r.start = start;
  r.moe_layers = moe_layers;
  for (int row = 0; row < r.rows; ++row)
    for (int l = 0; l < r.layers; ++l)
      for (int j = 0; j < k; ++j) {
        const uint8_t* d = bytes.data() + row * per_row +
                           (size_t(moe_layers[size_t(l)]) * size_t(k) + size_t(j)) * 4;
        const int32_t v = int32_t(uint32_t(d[0]) | uint32_t(d[1]) << 8 | uint32_t(d[2]) << 16 |
                                  uint32_t(d[3]) << 24);
        r.at(row, l, j) = int16_t(v);
      }
  return r;
}

RouteArray route_rows(const RouteArray& r, int begin, int end) {
  begin = std::clamp(begin, r.start, r.start + r.rows);
  end = std::clamp(end, begin, r.start + r.rows);
  RouteArray out(end - begin, r.layers, r.k);
  out.start = begin;
  out.moe_layers = r.moe_layers;
  out.num_experts = r.num_experts;
  if (out.rows)
    std::memcpy(out.data.data(), r.row(begin - r.start), out.data.size() * sizeof(int16_t));
  if (r.has_weights()) {
    const size_t at = size_t(begin - r.start) * size_t(r.layers) * size_t(r.k);
    out.weights.assign(r.weights.begin() + ptrdiff_t(at),
                       r.weights.begin() + ptrdiff_t(at + out.data.size()));
  }
  return out;
}

std::string npy_base64(const RouteArray& r) {
  const std::string bytes = npy_bytes(r);
  return base64_encode(bytes.data(), bytes.size());
}

std::string npy_weights_base64(const RouteArray& r) {
  const std::string bytes = npy_weight_bytes(r);
  return base64_encode(bytes.data(), bytes.size());
}

}  // namespace r3
