#include "engine/request_fields.h"

#include <algorithm>
#include <climits>
#include <limits>

namespace r3 {

using json = nlohmann::json;

namespace {

std::vector<std::string> split(const std::string& names) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= names.size()) {
    const size_t bar = names.find('|', at);
    out.push_back(names.substr(at, bar == std::string::npos ? std::string::npos : bar - at));
    if (bar == std::string::npos) break;
    at = bar + 1;
  }
  return out;
}

// body's value at a possibly dotted name; null when absent or null (a non-object parent too:
// the front end refuses that under the parent's own name first).
const json* lookup(const json& body, const std::string& name) {
  const json* at = &body;
  size_t from = 0;
  while (true) {
    const size_t dot = name.find('.', from);
    const std::string key = name.substr(from, dot == std::string::npos ? dot : dot - from);
    if (!at->is_object() || !at->contains(key) || (*at)[key].is_null()) return nullptr;
    at = &(*at)[key];
    if (dot == std::string::npos) return at;
    from = dot + 1;
  }
}

[[noreturn]] void refuse(const RequestField& row, const std::string& name, const std::string& why) {
  throw RequestFieldError(row.option, name, "\"" + name + "\" " + why);
}

bool fits(const json& v, int64_t lo, int64_t hi) {
  // nlohmann reads every non-negative integer as unsigned: past INT64_MAX it is out of any range.
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    return false;
  const int64_t x = v.get<int64_t>();
  return x >= lo && x <= hi;
}

}  // namespace

void check_field(const RequestField& row, const std::string& name, const json& v) {
  switch (row.kind) {
    case FieldKind::Int:
      if (!v.is_number_integer()) refuse(row, name, "must be an integer");
      if (!fits(v, row.lo, row.hi))
        refuse(row, name,
               "is out of range [" + std::to_string(row.lo) + ", " + std::to_string(row.hi) + "]");
      return;
    case FieldKind::Number:
      if (!v.is_number()) refuse(row, name, "must be a number");
      return;
    case FieldKind::Bool:
      if (!v.is_boolean()) refuse(row, name, "must be true or false");
      return;
    case FieldKind::Seed:
      if (!v.is_number_integer()) refuse(row, name, "must be an integer");
      if (!v.is_number_unsigned() && v.get<int64_t>() < 0) refuse(row, name, "must be >= 0");
      return;
    case FieldKind::TokenIds:
      if (!v.is_array()) refuse(row, name, "must be a list of token ids");
      for (size_t i = 0; i < v.size(); ++i) {
        if (!v[i].is_number_integer())
          refuse(row, name,
                 "must hold integer token ids (element " + std::to_string(i) + " is not)");
        if (!fits(v[i], INT32_MIN, INT32_MAX))
          refuse(row, name, "element " + std::to_string(i) + " is not a valid token id");
      }
      return;
    case FieldKind::Strings:
      if (!v.is_string() && !v.is_array())
        refuse(row, name, "must be a string or a list of strings");
      for (const json& s : v.is_string() ? json::array({v}) : v) {
        if (!s.is_string()) refuse(row, name, "must be a string or a list of strings");
        if (s.get<std::string>().empty()) refuse(row, name, "holds an empty string");
      }
      return;
  }
}

namespace {

int as_int(const json& v) { return int(v.get<int64_t>()); }

std::vector<std::string> as_strings(const json& v) {
  if (v.is_string()) return {v.get<std::string>()};
  return v.get<std::vector<std::string>>();
}

}  // namespace

const std::vector<RequestField>& request_fields() {
  using K = FieldKind;
  // names: Completions, Chat, Generate (SGLang), Jsonl, Python.
  static const std::vector<RequestField> rows = {
      {"prompt",
       K::TokenIds,
       0,
       0,
       {"prompt", "messages", "input_ids", "prompt_token_ids", "prompts"}},
      {"max_tokens",
       K::Int,
       0,
       INT32_MAX,
       {"max_tokens", "max_completion_tokens|max_tokens", "sampling_params.max_new_tokens",
        "max_new_tokens|max_tokens", "max_tokens"},
       false,
       [](SamplingParams& p, const json& v) { p.max_tokens = as_int(v); }},
      {"temperature",
       K::Number,
       0,
       0,
       {"temperature", "temperature", "sampling_params.temperature", "temperature", "temperature"},
       false,
       [](SamplingParams& p, const json& v) { p.temperature = v.get<float>(); }},
      {"top_p",
       K::Number,
       0,
       0,
       {"top_p", "top_p", "sampling_params.top_p", "top_p", "top_p"},
       false,
       [](SamplingParams& p, const json& v) { p.top_p = v.get<float>(); }},
      {"top_k",
       K::Int,
       -1,
       INT32_MAX,
       {"top_k", "top_k", "sampling_params.top_k", "top_k", "top_k"},
       false,
       [](SamplingParams& p, const json& v) { p.top_k = as_int(v); }},
      {"seed",
       K::Seed,
       0,
       0,
       {"seed", "seed", "sampling_params.seed|sampling_params.sampling_seed|sampling_seed", "seed",
        "seed"},
       false,
       [](SamplingParams& p, const json& v) {
         p.seed = v.is_number_unsigned() ? v.get<uint64_t>() : uint64_t(v.get<int64_t>());
       }},
      {"stop_token_ids",
       K::TokenIds,
       0,
       0,
       {"stop_token_ids", "stop_token_ids", "sampling_params.stop_token_ids", "stop_token_ids",
        "stop_token_ids"},
       false,
       [](SamplingParams& p, const json& v) { p.stop_token_ids = v.get<std::vector<int>>(); }},
      {"stop",
       K::Strings,
       0,
       0,
       {"stop", "stop", "sampling_params.stop", "stop", "stop"},
       false,
       [](SamplingParams& p, const json& v) { p.stop = as_strings(v); }},
      {"include_stop_str_in_output",
       K::Bool,
       0,
       0,
       {"include_stop_str_in_output", "include_stop_str_in_output", "sampling_params.no_stop_trim",
        "include_stop_str_in_output", "include_stop_str_in_output"},
       false,
       [](SamplingParams& p, const json& v) { p.include_stop_str_in_output = v.get<bool>(); }},
      {"skip_special_tokens",
       K::Bool,
       0,
       0,
       {"skip_special_tokens", "skip_special_tokens", "sampling_params.skip_special_tokens",
        "skip_special_tokens", "skip_special_tokens"},
       false,
       [](SamplingParams& p, const json& v) { p.skip_special_tokens = v.get<bool>(); }},
      {"ignore_eos",
       K::Bool,
       0,
       0,
       {"ignore_eos", "ignore_eos", "sampling_params.ignore_eos", "ignore_eos", "ignore_eos"},
       false,
       [](SamplingParams& p, const json& v) { p.ignore_eos = v.get<bool>(); }},
      {"logprobs",
       K::Bool,
       0,
       0,
       {"", "", "", "logprobs", ""},
       false,
       [](SamplingParams& p, const json& v) { p.logprobs = v.get<bool>(); }},
      {"return_routed_experts",
       K::Bool,
       0,
       0,
       {"return_routed_experts", "return_routed_experts", "return_routed_experts",
        "return_routed_experts", "return_routed_experts"},
       false,
       [](SamplingParams& p, const json& v) { p.return_routed_experts = v.get<bool>(); }},
      // vLLM's routed_experts_prompt_start (vllm #51906) is the same cut within the prompt (the
      // front end checks it against the prompt); SGLang names it routed_experts_start_len.
      {"routed_experts_start",
       K::Int,
       0,
       INT32_MAX,
       {"routed_experts_start|routed_experts_prompt_start",
        "routed_experts_start|routed_experts_prompt_start",
        "routed_experts_start_len|routed_experts_start", "routed_experts_start",
        "routed_experts_start|routed_experts_prompt_start"},
       true,
       [](SamplingParams& p, const json& v) { p.routed_experts_start = as_int(v); }},
      {"return_routed_expert_weights",
       K::Bool,
       0,
       0,
       {"return_routed_expert_weights", "return_routed_expert_weights",
        "return_routed_expert_weights", "return_routed_expert_weights",
        "return_routed_expert_weights"},
       false,
       [](SamplingParams& p, const json& v) { p.return_routed_expert_weights = v.get<bool>(); }},
      // Read by each front end in its own shape: OpenAI's "logprobs" is true or a count, chat's
      // top_logprobs needs "logprobs": true, SGLang's come only with return_logprob, vLLM's
      // prompt_logprobs is a count that also starts the prompt's scores at 0.
      {"top_logprobs",
       K::Int,
       0,
       kMaxTopLogprobs,
       {"logprobs", "top_logprobs", "top_logprobs_num", "", "logprobs"}},
      {"prompt_logprobs_start",
       K::Int,
       -1,
       INT32_MAX,
       {"prompt_logprobs", "prompt_logprobs", "logprob_start_len", "", "prompt_logprobs"}},
  };
  return rows;
}

std::map<std::string, std::string> read_request_fields(const json& body, FrontEnd fe,
                                                       SamplingParams& p) {
  std::map<std::string, std::string> given;
  for (const RequestField& row : request_fields()) {
    const std::string names = row.names[size_t(fe)];
    if (!row.set || names.empty()) continue;
    const json* value = nullptr;
    std::string name;
    for (const std::string& n : split(names)) {
      const json* v = lookup(body, n);
      if (!v) continue;
      if (value && row.one_of)
        throw RequestFieldError(row.option, n, "give one of \"" + name + "\" and \"" + n + "\"");
      if (!value) value = v, name = n;
    }
    if (!value) continue;
    check_field(row, name, *value);
    row.set(p, *value);
    given[row.option] = name;
  }
  return given;
}

const RequestField& request_field(const std::string& option) {
  for (const RequestField& row : request_fields())
    if (option == row.option) return row;
  throw Error("the request vocabulary has no option \"" + option + "\"");
}

std::string name_in(const std::string& option, FrontEnd fe) {
  for (const RequestField& row : request_fields())
    if (option == row.option && *row.names[size_t(fe)]) return split(row.names[size_t(fe)])[0];
  return option;
}

std::vector<std::string> names_in(FrontEnd fe, const std::string& under) {
  const std::string prefix = under.empty() ? "" : under + ".";
  std::vector<std::string> out;
  for (const RequestField& row : request_fields())
    if (*row.names[size_t(fe)])
      for (const std::string& n : split(row.names[size_t(fe)])) {
        if (n.compare(0, prefix.size(), prefix) != 0) continue;
        const std::string rest = n.substr(prefix.size());
        const std::string part = rest.substr(0, rest.find('.'));
        if (std::find(out.begin(), out.end(), part) == out.end()) out.push_back(part);
      }
  return out;
}

}  // namespace r3
