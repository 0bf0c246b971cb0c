#include "engine/request_json.h"

#include "core/error.h"
#include "engine/request_fields.h"

namespace r3 {

using json = nlohmann::json;

void read_sampling_params(const json& j, SamplingParams& p) {
  read_request_fields(j, FrontEnd::Jsonl, p);
}

ParsedRequest parse_request_json(const json& j) {
  if (!j.is_object()) throw Error("a request must be a JSON object");
  ParsedRequest r;
  if (j.contains("prompt") && j["prompt"].is_string() && !j.contains("prompt_token_ids")) {
    r.prompt_text = j["prompt"].get<std::string>();
    if (r.prompt_text.empty()) throw Error("\"prompt\" is empty");
  } else {
    if (!j.contains("prompt_token_ids"))
      throw Error("missing \"prompt_token_ids\" (or a \"prompt\" text)");
    check_field(request_field("prompt"), "prompt_token_ids", j["prompt_token_ids"]);
    r.prompt = j["prompt_token_ids"].get<std::vector<int>>();
  }
  read_sampling_params(j, r.params);
  return r;
}

json output_to_json(const RequestOutput& o, int64_t index) {
  json j;
  if (index >= 0) j["index"] = index;
  j["prompt_token_ids"] = o.prompt_token_ids;
  j["token_ids"] = o.token_ids;
  j["text"] = o.text;
  json lp = json::array();
  for (float f : o.logprobs) lp.push_back(double(f));  // exact: every float is a double
  j["logprobs"] = lp;
  j["finish_reason"] = o.finish_reason;
  if (!o.stop_str.empty()) j["stop_reason"] = o.stop_str;
  j["weight_versions"] = o.weight_versions;
  if (o.routed_experts) j["routed_experts"] = routes_to_json(*o.routed_experts);
  if (o.routed_experts && o.routed_experts->has_weights())
    j["routed_expert_weights"] = route_weights_to_json(*o.routed_experts);
  if (!o.routes_error.empty()) j["routes_error"] = o.routes_error;
  if (!o.error.empty()) j["error"] = o.error;
  j["num_cached_tokens"] = o.num_cached_tokens;  // prompt tokens served from the prefix cache
  j["num_preemptions"] = o.num_preemptions;
  return j;
}

}  // namespace r3
