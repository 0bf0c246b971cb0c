#include "core/json_limits.h"

#include "core/error.h"

namespace r3 {

nlohmann::json parse_json_bounded(std::string_view text, const std::string& what, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"')
      in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        throw Error(what + ": JSON nested deeper than " + std::to_string(max_depth) + " levels");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return nlohmann::json::parse(text.begin(), text.end());
}

}  // namespace r3
