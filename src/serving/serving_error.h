// What the serving layer (the engine loop and its channels) refuses, typed, so each front end
// says it in its own terms: the HTTP layer maps a kind to a status code (BadRequest 400 naming the
// field, Unavailable 503), the Python module to r3.Error. Nothing here knows of HTTP.
#pragma once
#include <stdexcept>
#include <string>

namespace r3::serving {

// Not an r3::Error on purpose: handlers that turn an r3::Error into a 400 (a bad request's
// values) must not catch a 503 by the way.
class ServingError : public std::runtime_error {
 public:
  enum class Kind {
    BadRequest,   // the call itself is wrong (a duplicate request id, an unknown mode): `field`
                  // names it
    Unavailable,  // the engine cannot take it now (shutting down, draining, failed)
  };
  ServingError(Kind kind, const std::string& message, std::string field = "")
      : std::runtime_error(message), kind_(kind), field_(std::move(field)) {}
  Kind kind() const { return kind_; }
  const std::string& field() const { return field_; }

 private:
  Kind kind_;
  std::string field_;
};

inline ServingError unavailable(const std::string& message) {
  return ServingError(ServingError::Kind::Unavailable, message);
}
inline ServingError bad_call(const std::string& message, const std::string& field) {
  return ServingError(ServingError::Kind::BadRequest, message, field);
}

}  // namespace r3::serving
