// EngineConfig as JSON: what rank 0 of an expert-parallel group sends the other ranks so that
// each builds the same engine (engine/expert_exchange.h).
#pragma once
#include <string>

#include "engine/engine.h"

namespace r3 {

std::string engine_config_to_json(const EngineConfig& c);
// Throws r3::Error on malformed JSON or a missing field.
EngineConfig engine_config_from_json(const std::string& text);

}  // namespace r3
