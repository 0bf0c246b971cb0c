// r3's one exception type: every user-facing failure (bad checkpoint, bad request, unsupported
// option) is an r3::Error with a message that names what was wrong and where.
#pragma once
#include <stdexcept>
#include <string>

namespace r3 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A refused request, naming the request field it concerns in r3's own vocabulary (the members
// of SamplingParams, and "prompt"), so each front end can report the field under its own name
// instead of guessing it from the message.
class FieldError : public Error {
 public:
  FieldError(std::string field, const std::string& what) : Error(what), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

}  // namespace r3
