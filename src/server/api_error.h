// The error every HTTP endpoint answers with: a 4xx/5xx status and the OpenAI error body
// {"error":{"message","type","param","code"}}. Handlers throw ApiError; the server turns it into
// the reply and keeps serving.
#pragma once
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "serving/serving_error.h"

namespace r3::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string type = "invalid_request_error",
           std::string param = "")
      : std::runtime_error(message),
        status_(status),
        type_(std::move(type)),
        param_(std::move(param)) {}
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }

 private:
  int status_;
  std::string type_, param_;
};

// 400 naming the request field that was wrong.
inline ApiError bad_request(const std::string& message, const std::string& param = "") {
  return ApiError(400, message, "invalid_request_error", param);
}

// {"error":{"message":..., "type":..., "param": null | "...", "code": status}}
inline nlohmann::json error_body(const std::string& message, const std::string& type,
                                 const std::string& param, int status) {
  nlohmann::json e = {{"message", message}, {"type", type}, {"code", status}};
  e["param"] = param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param);
  return {{"error", e}};
}

// The serving layer's refusals in HTTP's terms: a bad call is a 400 naming its field, an engine
// that cannot take the call (shutting down, draining, failed) a 503.
inline ApiError api_error_of(const serving::ServingError& e) {
  if (e.kind() == serving::ServingError::Kind::BadRequest) return bad_request(e.what(), e.field());
  return ApiError(503, e.what(), "server_error");
}

inline nlohmann::json error_body(const ApiError& e) {
  return error_body(e.what(), e.type(), e.param(), e.status());
}

}  // namespace r3::server
