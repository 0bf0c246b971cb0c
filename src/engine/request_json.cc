#include "engine/request_json.h"

#include "core/error.h"

namespace r3 {

using json = nlohmann::json;

namespace {

// An integer that fits int32 (unsigned JSON values above 2^63 would wrap through int64).
bool fits_int32(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>() <= uint64_t(INT32_MAX);
  const int64_t x = v.get<int64_t>();
  return x >= INT32_MIN && x <= INT32_MAX;
}

int get_int(const json& j, const char* key, int dflt) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  if (!j[key].is_number_integer()) throw Error(std::string("\"") + key + "\" must be an integer");
  if (!fits_int32(j[key])) throw Error(std::string("\"") + key + "\" is out of range");
  return int(j[key].get<int64_t>());
}

float get_float(const json& j, const char* key, float dflt) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  if (!j[key].is_number()) throw Error(std::string("\"") + key + "\" must be a number");
  return j[key].get<float>();
}

bool get_bool(const json& j, const char* key, bool dflt) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  if (!j[key].is_boolean()) throw Error(std::string("\"") + key + "\" must be true or false");
  return j[key].get<bool>();
}

std::vector<int> get_ids(const json& j, const char* key) {
  if (!j[key].is_array()) throw Error(std::string("\"") + key + "\" must be a list of token ids");
  std::vector<int> out;
  for (auto& v : j[key]) {
    if (!v.is_number_integer()) throw Error(std::string("\"") + key + "\" must hold integers");
    if (!fits_int32(v)) throw Error(std::string("\"") + key + "\" holds an out-of-range id");
    out.push_back(int(v.get<int64_t>()));
  }
  return out;
}

}  // namespace

void read_sampling_params(const json& j, SamplingParams& p) {
  p.max_tokens = get_int(j, "max_tokens", p.max_tokens);
  if (j.contains("max_new_tokens")) p.max_tokens = get_int(j, "max_new_tokens", p.max_tokens);
  p.temperature = get_float(j, "temperature", p.temperature);
  p.top_p = get_float(j, "top_p", p.top_p);
  p.top_k = get_int(j, "top_k", p.top_k);
  if (j.contains("seed") && !j["seed"].is_null()) {
    if (!j["seed"].is_number_integer()) throw Error("\"seed\" must be an integer");
    p.seed = j["seed"].get<uint64_t>();
  }
  if (j.contains("stop_token_ids") && !j["stop_token_ids"].is_null())
    p.stop_token_ids = get_ids(j, "stop_token_ids");
  if (j.contains("stop") && !j["stop"].is_null()) {
    const json& st = j["stop"];
    p.stop.clear();
    if (st.is_string())
      p.stop.push_back(st.get<std::string>());
    else if (st.is_array())
      for (const json& x : st) {
        if (!x.is_string()) throw Error("\"stop\" must be a string or a list of strings");
        p.stop.push_back(x.get<std::string>());
      }
    else
      throw Error("\"stop\" must be a string or a list of strings");
  }
  p.include_stop_str_in_output =
      get_bool(j, "include_stop_str_in_output", p.include_stop_str_in_output);
  p.skip_special_tokens = get_bool(j, "skip_special_tokens", p.skip_special_tokens);
  p.ignore_eos = get_bool(j, "ignore_eos", p.ignore_eos);
  if (j.contains("logprobs") && j["logprobs"].is_boolean()) p.logprobs = j["logprobs"].get<bool>();
  p.return_routed_experts = get_bool(j, "return_routed_experts", p.return_routed_experts);
  p.routed_experts_start = get_int(j, "routed_experts_start", p.routed_experts_start);
  p.return_routed_expert_weights =
      get_bool(j, "return_routed_expert_weights", p.return_routed_expert_weights);
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
    r.prompt = get_ids(j, "prompt_token_ids");
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
