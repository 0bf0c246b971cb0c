#include "server/route_reply.h"

#include "core/error.h"
#include "routes/route_envelope.h"
#include "server/api_error.h"

namespace r3::server {

using json = nlohmann::json;

std::optional<RouteFormat> opt_route_format(const json& body) {
  if (!body.contains("routed_experts_format") || body["routed_experts_format"].is_null())
    return std::nullopt;
  if (!body["routed_experts_format"].is_string())
    throw bad_request("\"routed_experts_format\" must be a string", "routed_experts_format");
  try {
    return parse_route_format(body["routed_experts_format"].get<std::string>());
  } catch (const Error& e) {
    throw bad_request(e.what(), "routed_experts_format");
  }
}

void put_routes(json& obj, const RequestOutput& o, const RouteReply& how, bool chunk) {
  if (!o.routed_experts) return;
  const RouteArray& r = *o.routed_experts;
  obj["routed_experts_format"] = route_format_name(how.format);
  const bool weights = r.has_weights();
  switch (how.format) {
    case RouteFormat::R3:
    case RouteFormat::Nrlre1:  // NeMo-RL's envelope holds integer ids only
      obj["routed_experts"] =
          how.format == RouteFormat::R3 ? routes_to_json(r) : json(encode_envelope(r));
      if (weights) obj["routed_expert_weights"] = route_weights_to_json(r);
      break;
    case RouteFormat::Sglang:
      obj["routed_experts"] = encode_sglang_routes(r, how.num_hidden_layers);
      if (weights)
        obj["routed_expert_weights"] = encode_sglang_route_weights(r, how.num_hidden_layers);
      break;
    case RouteFormat::Vllm: {
      const int P = int(o.prompt_token_ids.size());
      const RouteArray prompt = route_rows(r, r.start, P),
                       generated = route_rows(r, P, r.start + r.rows);
      if (!chunk || r.start < P) {
        obj["prompt_routed_experts"] = npy_base64(prompt);
        if (weights) obj["prompt_routed_expert_weights"] = npy_weights_base64(prompt);
      }
      obj["routed_experts"] = npy_base64(generated);
      if (weights) obj["routed_expert_weights"] = npy_weights_base64(generated);
      break;
    }
  }
}

}  // namespace r3::server
