#include "server/json_fields.h"

#include "core/error.h"
#include "core/json_limits.h"
#include "server/api_error.h"
#include "text/tokenizer.h"

namespace r3::server {

json parse_body(const std::string& body) {
  json j;
  try {
    // Nesting is bounded before parsing: a deep document costs memory far beyond its size.
    j = parse_json_bounded(body, "request body", kMaxJsonDepth);
  } catch (const json::exception& e) {
    throw bad_request(std::string("malformed JSON body: ") + e.what());
  } catch (const Error& e) {
    throw bad_request(std::string("malformed JSON body: ") + e.what());
  }
  if (!j.is_object()) throw bad_request("the request body must be a JSON object");
  return j;
}

static bool given(const json& j, const std::string& key) {
  return j.contains(key) && !j[key].is_null();
}

void refuse_unknown_fields(const json& obj, const std::string& prefix,
                           const std::vector<std::string>& known) {
  for (auto& [k, v] : obj.items()) {
    if (v.is_null()) continue;
    bool ok = false;
    for (const std::string& n : known) ok = ok || k == n;
    if (!ok)
      throw bad_request("unknown field \"" + prefix + k + "\" (r3 does not implement it)",
                        prefix + k);
  }
}

namespace {
// j[key] checked by the request vocabulary's rule for its kind (one wording for every check), a
// 400 naming param; null when absent or null.
const json* checked(const json& j, const std::string& key, const std::string& param, FieldKind kind,
                    int64_t lo = 0, int64_t hi = 0) {
  if (!given(j, key)) return nullptr;
  try {
    check_field({key.c_str(), kind, lo, hi, {}}, param, j[key]);
  } catch (const RequestFieldError& e) {
    throw bad_request(e.what(), param);
  }
  return &j[key];
}
}  // namespace

std::optional<int64_t> opt_int(const json& j, const std::string& key, const std::string& param,
                               int64_t lo, int64_t hi) {
  if (const json* v = checked(j, key, param, FieldKind::Int, lo, hi)) return v->get<int64_t>();
  return std::nullopt;
}

std::optional<double> opt_number(const json& j, const std::string& key, const std::string& param) {
  if (const json* v = checked(j, key, param, FieldKind::Number)) return v->get<double>();
  return std::nullopt;
}

std::optional<bool> opt_bool(const json& j, const std::string& key, const std::string& param) {
  if (const json* v = checked(j, key, param, FieldKind::Bool)) return v->get<bool>();
  return std::nullopt;
}

std::optional<std::string> opt_string(const json& j, const std::string& key,
                                      const std::string& param) {
  if (!given(j, key)) return std::nullopt;
  if (!j[key].is_string()) throw bad_request("\"" + param + "\" must be a string", param);
  return j[key].get<std::string>();
}

std::vector<int> token_id_list(const json& v, const std::string& param) {
  try {
    check_field(request_field("prompt"), param, v);
  } catch (const RequestFieldError& e) {
    throw bad_request(e.what(), param);
  }
  return v.get<std::vector<int>>();
}

static bool is_text(const json& v) {
  if (v.is_string()) return true;
  if (!v.is_array() || v.empty()) return false;
  for (const auto& x : v)
    if (!x.is_string()) return false;
  return true;
}

std::vector<std::vector<int>> prompt_batch(const json& v, const std::string& param,
                                           const text::Tokenizer* tok, bool add_special_tokens) {
  if (is_text(v)) {
    if (!tok)
      throw bad_request(
          "the model has no tokenizer (no tokenizer.json; start r3 serve with --tokenizer DIR); "
          "send "
          "token ids",
          param);
    std::vector<std::vector<int>> out;
    auto encode = [&](const json& s) {
      const std::string t = s.get<std::string>();
      if (t.empty()) throw bad_request("\"" + param + "\" holds an empty prompt", param);
      std::vector<int32_t> ids;
      try {
        ids = tok->encode(t, add_special_tokens);
      } catch (const Error& e) {
        throw bad_request(std::string("\"") + param + "\": " + e.what(), param);
      }
      out.emplace_back(ids.begin(), ids.end());
    };
    if (v.is_string())
      encode(v);
    else
      for (const auto& s : v) encode(s);
    return out;
  }
  if (!v.is_array() || v.empty())
    throw bad_request("\"" + param +
                          "\" must be text, a list of texts, a non-empty list of token ids or a "
                          "list of such lists",
                      param);
  std::vector<std::vector<int>> out;
  if (v[0].is_array()) {
    for (const auto& p : v) {
      if (!p.is_array()) throw bad_request("\"" + param + "\" mixes lists and ids", param);
      out.push_back(token_id_list(p, param));
      if (out.back().empty()) throw bad_request("\"" + param + "\" holds an empty prompt", param);
    }
  } else {
    out.push_back(token_id_list(v, param));
  }
  return out;
}

void refuse_unknown_fields(const json& obj, const std::string& prefix, FrontEnd fe,
                           std::initializer_list<const char*> also) {
  std::vector<std::string> known =
      names_in(fe, prefix.empty() ? "" : prefix.substr(0, prefix.size() - 1));
  known.insert(known.end(), also.begin(), also.end());
  refuse_unknown_fields(obj, prefix, known);
}

std::map<std::string, std::string> read_request_options(const json& body, FrontEnd fe,
                                                        SamplingParams& p, bool has_tokenizer) {
  std::map<std::string, std::string> given;
  try {
    given = read_request_fields(body, fe, p);
  } catch (const RequestFieldError& e) {
    throw bad_request(e.what(), e.name());
  }
  if (auto stop = given.find("stop"); stop != given.end() && !p.stop.empty() && !has_tokenizer)
    throw bad_request(
        "the model has no tokenizer; stop strings cannot be matched (use \"stop_token_ids\")",
        stop->second);
  if (auto start = given.find("routed_experts_start");
      start != given.end() && !p.return_routed_experts && p.routed_experts_start)
    throw bad_request("\"" + start->second + "\" needs \"return_routed_experts\": true",
                      start->second);
  return given;
}

std::string param_of_field(const std::string& field, FrontEnd api) {
  return field.empty() ? field : name_in(field, api);
}

}  // namespace r3::server
