// Typed reads of request JSON for the HTTP endpoints. Every wrong type or out-of-range value
// throws a 400 ApiError whose param names the field (dotted for nested fields), so a client
// learns exactly what to fix. Absent and null fields are "not given".
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/request_fields.h"

namespace r3::text {
class Tokenizer;
}

namespace r3::server {

using json = nlohmann::json;

// The request body as a JSON object (400 on malformed JSON or a non-object).
json parse_body(const std::string& body);

std::optional<int64_t> opt_int(const json& j, const std::string& key, const std::string& param,
                               int64_t lo, int64_t hi);
std::optional<double> opt_number(const json& j, const std::string& key, const std::string& param);
std::optional<bool> opt_bool(const json& j, const std::string& key, const std::string& param);
std::optional<std::string> opt_string(const json& j, const std::string& key,
                                      const std::string& param);
// A field outside `known` with a non-null value is a 400 naming it (prefix + key): an option a
// client relies on must never be silently ignored. null counts as absent.
void refuse_unknown_fields(const json& obj, const std::string& prefix,
                           const std::vector<std::string>& known);
// The same, knowing the names the request vocabulary gives `fe` there (engine/request_fields.h)
// and `also` (the endpoint's own fields: n, stream, model, ...).
void refuse_unknown_fields(const json& obj, const std::string& prefix, FrontEnd fe,
                           std::initializer_list<const char*> also);
// read_request_fields with its refusals as 400s naming the field as the client sent it, and the
// checks between options every HTTP front end makes: stop strings need a tokenizer, a route cut
// needs return_routed_experts.
std::map<std::string, std::string> read_request_options(const json& body, FrontEnd fe,
                                                        SamplingParams& p, bool has_tokenizer);

// A list of token ids (int32 range; the engine checks them against the vocabulary).
std::vector<int> token_id_list(const json& v, const std::string& param);

// One prompt or a batch: a list of ids, a list of lists of ids, a string or a list of strings
// (encoded with `tok`, its template's special tokens added as Hugging Face's tokenizer(text)
// does; a 400 when the model has no tokenizer).
std::vector<std::vector<int>> prompt_batch(const json& v, const std::string& param,
                                           const text::Tokenizer* tok = nullptr,
                                           bool add_special_tokens = true);

// An engine refusal's field (FieldError::field, r3's name; "" for none) under the endpoint's
// own name, from the request vocabulary (name_in): "prompt" is prompt / messages / input_ids,
// SGLang's sampling fields sit under sampling_params., and so on.
std::string param_of_field(const std::string& field, FrontEnd api);

}  // namespace r3::server
