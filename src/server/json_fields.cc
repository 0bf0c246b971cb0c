#include "server/json_fields.h"

#include <limits>

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

std::optional<int64_t> opt_int(const json& j, const std::string& key, const std::string& param,
                               int64_t lo, int64_t hi) {
  if (!given(j, key)) return std::nullopt;
  const json& v = j[key];
  if (!v.is_number_integer()) throw bad_request("\"" + param + "\" must be an integer", param);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    throw bad_request("\"" + param + "\" is out of range [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]",
                      param);
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw bad_request("\"" + param + "\" is out of range [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "]",
                      param);
  return x;
}

std::optional<double> opt_number(const json& j, const std::string& key, const std::string& param) {
  if (!given(j, key)) return std::nullopt;
  if (!j[key].is_number()) throw bad_request("\"" + param + "\" must be a number", param);
  return j[key].get<double>();
}

std::optional<bool> opt_bool(const json& j, const std::string& key, const std::string& param) {
  if (!given(j, key)) return std::nullopt;
  if (!j[key].is_boolean()) throw bad_request("\"" + param + "\" must be true or false", param);
  return j[key].get<bool>();
}

std::optional<uint64_t> opt_seed(const json& j, const std::string& key, const std::string& param) {
  if (!given(j, key)) return std::nullopt;
  const json& v = j[key];
  if (!v.is_number_integer()) throw bad_request("\"" + param + "\" must be an integer", param);
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  const int64_t x = v.get<int64_t>();
  if (x < 0) throw bad_request("\"" + param + "\" must be >= 0", param);
  return uint64_t(x);
}

std::optional<std::string> opt_string(const json& j, const std::string& key,
                                      const std::string& param) {
  if (!given(j, key)) return std::nullopt;
  if (!j[key].is_string()) throw bad_request("\"" + param + "\" must be a string", param);
  return j[key].get<std::string>();
}

bool is_token_id_list(const json& v) {
  if (!v.is_array()) return false;
  for (const auto& x : v)
    if (!x.is_number_integer()) return false;
  return true;
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

std::vector<std::string> stop_strings(const json& v, const std::string& param) {
  std::vector<std::string> out;
  if (v.is_null()) return out;
  if (v.is_string())
    out.push_back(v.get<std::string>());
  else if (v.is_array()) {
    for (const auto& s : v) {
      if (!s.is_string())
        throw bad_request("\"" + param + "\" must be a string or a list of strings", param);
      out.push_back(s.get<std::string>());
    }
  } else
    throw bad_request("\"" + param + "\" must be a string or a list of strings", param);
  for (const std::string& s : out)
    if (s.empty()) throw bad_request("\"" + param + "\" holds an empty string", param);
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
                                                        SamplingParams& p) {
  try {
    return read_request_fields(body, fe, p);
  } catch (const RequestFieldError& e) {
    throw bad_request(e.what(), e.name());
  }
}

std::string param_of_field(const std::string& field, FrontEnd api) {
  return field.empty() ? field : name_in(field, api);
}

}  // namespace r3::server
