// Routes in a reply, in the wire format the request (or the server default) chose
// (routes/route_formats.h): "routed_experts" holds them, and for the vllm format the prompt part
// goes to "prompt_routed_experts" as vLLM splits them. With return_routed_expert_weights the gate
// weights go beside them in the same shape as float32: "routed_expert_weights" (and
// "prompt_routed_expert_weights"): r3's transport object (dtype float32) for r3 and nrlre1 (the
// envelope holds integers only), base64 float32 [rows, num_hidden_layers, K] for sglang, float32
// .npy for vllm.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>

#include "engine/engine.h"
#include "routes/route_formats.h"

namespace r3::server {

struct RouteReply {
  RouteFormat format = RouteFormat::R3;
  int num_hidden_layers = 0;  // the sglang format's layer axis
};

// "routed_experts_format" of a request body (null or absent: none; a bad name is a 400).
std::optional<RouteFormat> opt_route_format(const nlohmann::json& body);

// Writes o's routes (if any) into obj. chunk: a streamed chunk's rows, where the vllm format
// leaves out an empty prompt part (only the first chunk has prompt rows).
void put_routes(nlohmann::json& obj, const RequestOutput& o, const RouteReply& how,
                bool chunk = false);

}  // namespace r3::server
