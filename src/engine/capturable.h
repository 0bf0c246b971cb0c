// C2: fail closed. Rejects, naming the option, every configuration in which r3 could not return
// faithful routes, instead of returning wrong ones.
#pragma once
#include "model/config.h"

namespace r3 {

struct EngineConfig;

// Throws r3::Error when routes are enabled on a configuration that cannot capture them.
void assert_capturable(const EngineConfig& cfg, const ModelConfig& model, int capture_slot_tokens);

}  // namespace r3
