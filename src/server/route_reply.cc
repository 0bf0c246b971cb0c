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
  switch (how.format) {
    case RouteFormat::R3:
      obj["routed_experts"] = routes_to_json(r);
      break;
    case RouteFormat::Sglang:
      obj["routed_experts"] = encode_sglang_routes(r, how.num_hidden_layers);
      break;
    case RouteFormat::Nrlre1:
      obj["routed_experts"] = encode_envelope(r);
      break;
    case RouteFormat::Vllm: {
      const int P = int(o.prompt_token_ids.size());
      if (!chunk || r.start < P)
        obj["prompt_routed_experts"] = npy_base64(route_rows(r, r.start, P));
      obj["routed_experts"] = npy_base64(route_rows(r, P, r.start + r.rows));
      break;
    }
  }
}

}  // namespace r3::server
