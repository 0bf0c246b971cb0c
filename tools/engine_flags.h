// Engine options shared by the verbs that start an engine (generate, serve, bench, align).
#pragma once
#include "args.h"
#include "engine/engine.h"

namespace r3::cli {

void add_engine_flags(Args& a);
EngineConfig engine_config_from(const Args& a);
std::vector<int> parse_int_list(const std::string& s, const std::string& flag);

}  // namespace r3::cli
