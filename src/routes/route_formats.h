// The wire formats RL frameworks decode routes from. r3 holds one representation (RouteArray:
// MoE layers only, logical ids, int16) and encodes it at the edge; each format states its layer
// layout (INTEROP.md, "Route wire formats"):
//   r3      the transport object of DESIGN.md (MoE layers, int16, with start and moe_layers)
//   sglang  base64 of little-endian int32 [rows, num_hidden_layers, K]: every decoder layer by
//           absolute id; a dense layer's entries are 0, as SGLang's capturer leaves them
//   vllm    base64 of an .npy array (MoE layers, int16), split as vLLM splits it: the prompt
//           part (positions [start, P)) and the generated part (positions [P, S-1))
//   nrlre1  NeMo-RL's envelope string "nrlre1:<dtype>:<R>x<L>x<K>:<base64>" (MoE layers)
#pragma once
#include <string>
#include <vector>

#include "routes/route_array.h"

namespace r3 {

enum class RouteFormat { R3, Sglang, Vllm, Nrlre1 };

// "r3" | "sglang" | "vllm" | "nrlre1"; anything else throws r3::Error naming the choices.
RouteFormat parse_route_format(const std::string& name);
const char* route_format_name(RouteFormat f);

std::string encode_sglang_routes(const RouteArray& r, int num_hidden_layers);
// The gate weights (RouteArray::weights) in the same layout, as little-endian float32; a dense
// layer's entries are 0.
std::string encode_sglang_route_weights(const RouteArray& r, int num_hidden_layers);
// The inverse, for clients and tests: [rows, num_hidden_layers, K] int32 back to the MoE columns
// `moe_layers` (throws r3::Error on a length that does not divide).
RouteArray decode_sglang_routes(const std::string& b64, int num_hidden_layers, int k,
                                const std::vector<int>& moe_layers, int start);

// Rows of the absolute positions [begin, end) (clamped to what r holds).
RouteArray route_rows(const RouteArray& r, int begin, int end);
// base64 of the .npy bytes (what vLLM sends for numpy arrays).
std::string npy_base64(const RouteArray& r);
// base64 of the weights' float32 .npy.
std::string npy_weights_base64(const RouteArray& r);

}  // namespace r3
