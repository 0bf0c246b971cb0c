// The model description as JSON: every field of visit_fields, nested as its dotted name says
// ("router.n_group" -> {"router": {"n_group": ...}}, "layers.3.moe" -> {"layers": [.., .., ..,
// {"moe": ...}]}), enums as their numbers, an absent optional part as null. /get_model_info
// carries it as "r3_model_config", and Python's LLM.model_config is the same object.
#pragma once
#include <nlohmann/json.hpp>

#include "model/config.h"

namespace r3 {

nlohmann::json model_config_json(const ModelConfig& c);

}  // namespace r3
