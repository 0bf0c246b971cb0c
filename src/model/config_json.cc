#include "model/config_json.h"

#include <cctype>
#include <string>
#include <type_traits>

namespace r3 {

nlohmann::json model_config_json(const ModelConfig& c) {
  nlohmann::json out = nlohmann::json::object();
  visit_fields(c, [&](const std::string& name, const auto& value) {
    using T = std::decay_t<decltype(value)>;
    nlohmann::json leaf;
    if constexpr (std::is_same_v<T, std::nullopt_t>)
      leaf = nullptr;
    else if constexpr (std::is_enum_v<T>)
      leaf = int(value);
    else
      leaf = value;
    nlohmann::json* node = &out;
    for (size_t at = 0;;) {
      const size_t dot = name.find('.', at);
      const std::string part = name.substr(at, dot == std::string::npos ? dot : dot - at);
      if (dot == std::string::npos) {
        (*node)[part] = std::move(leaf);
        return;
      }
      const bool index_next = std::isdigit(static_cast<unsigned char>(name[dot + 1]));
      if (node->is_array()) {  // layers, visited in order
        const size_t index = std::stoul(part);
        if (index == node->size()) node->push_back(nlohmann::json::object());
        node = &(*node)[index];
      } else {
        if (!node->contains(part))
          (*node)[part] = index_next ? nlohmann::json::array() : nlohmann::json::object();
        node = &(*node)[part];
      }
      at = dot + 1;
    }
  });
  return out;
}

}  // namespace r3
