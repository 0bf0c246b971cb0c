// The request vocabulary: one row per request option r3 reads (SamplingParams' members, and the
// prompt), its name in each front end, and the type and range its value must have. One reader
// checks and reads every front end's JSON by these rows, so a field's rule lives in one place;
// the HTTP layer maps an engine refusal's field back to the name the client used from the same
// rows. A front end's own shapes (OpenAI's "logprobs" as true or a count, vLLM's
// prompt_logprobs, SGLang's return_logprob gate, chat's logprobs/top_logprobs pair) are rows
// without a setter: named here, read by that front end.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/sampling.h"

namespace r3 {

// The front ends: OpenAI/vLLM /v1/completions and /v1/chat/completions, SGLang's /generate,
// `r3 generate`'s JSONL lines, and the Python SamplingParams' keyword arguments.
enum class FrontEnd { Completions, Chat, Generate, Jsonl, Python };
constexpr int kFrontEnds = 5;

enum class FieldKind {
  Int,       // an integer in [lo, hi]
  Number,    // any JSON number
  Bool,      // true or false
  Seed,      // an integer in [0, 2^64)
  TokenIds,  // a list of int32 token ids
  Strings,   // a string or a list of non-empty strings
};

struct RequestField {
  const char* option;  // r3's name: the SamplingParams member (FieldError::field)
  FieldKind kind;
  int64_t lo = 0, hi = 0;  // FieldKind::Int
  // The name in each front end, in FrontEnd's order; "" where it does not take the option.
  // "a|b": either name (the first given is read); SGLang's sampling fields are dotted
  // ("sampling_params.top_p": under the body's sampling_params object).
  std::array<const char*, kFrontEnds> names;
  bool one_of = false;  // a|b: giving both is an error, not the first winning
  // Stores a checked value into the request's options; null: named here, read by the front end
  // in its own shape.
  void (*set)(SamplingParams&, const nlohmann::json&) = nullptr;
};

const std::vector<RequestField>& request_fields();

// A value of the wrong type or out of range: names the option (field()) and the name it came
// under in the request (name()), e.g. "top_k" and "sampling_params.top_k".
class RequestFieldError : public FieldError {
 public:
  RequestFieldError(std::string option, std::string name, const std::string& what)
      : FieldError(std::move(option), what), name_(std::move(name)) {}
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// Reads every option `fe` names and a row reads (one with a setter) from body into p, each
// value checked by its row (throws RequestFieldError); absent and null values leave p's value
// (the front end's default). Returns the options given, each with the name it was given under.
std::map<std::string, std::string> read_request_fields(const nlohmann::json& body, FrontEnd fe,
                                                       SamplingParams& p);
// The row of `option` (throws r3::Error for an option the vocabulary lacks), and a value checked
// by it under the name it came under (throws RequestFieldError).
const RequestField& request_field(const std::string& option);
void check_field(const RequestField& row, const std::string& name, const nlohmann::json& value);
// The name fe gives `option` (the first of several); the option itself where fe has none.
std::string name_in(const std::string& option, FrontEnd fe);
// The names fe takes at the top of its body (under = ""; a dotted name counts as its first
// part) or inside one of its objects (under = "sampling_params").
std::vector<std::string> names_in(FrontEnd fe, const std::string& under = "");

}  // namespace r3
