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

}  // namespace r3
