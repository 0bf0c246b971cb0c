// JSON from outside (request bodies, config.json, safetensors headers) is parsed only after a
// linear pre-scan bounds its nesting: a deeply nested document would otherwise cost memory
// (and parse time) far beyond its size.
#pragma once
#include <nlohmann/json.hpp>
#include <string_view>

namespace r3 {

constexpr int kMaxJsonDepth = 64;

// Throws r3::Error("... nested deeper than N levels") naming `what`; otherwise parses like
// nlohmann::json::parse (its parse_error escapes as json::exception).
nlohmann::json parse_json_bounded(std::string_view text, const std::string& what,
                                  int max_depth = kMaxJsonDepth);

}  // namespace r3
