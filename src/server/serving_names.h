// The serving layer's names (src/serving/: the engine loop, its channels and refusals) as the
// HTTP layer uses them, declared once for every server file.
#pragma once
#include "serving/channel.h"
#include "serving/engine_loop.h"
#include "serving/serving_error.h"

namespace r3::server {

using serving::Channel;
using serving::EngineLoop;
using serving::Job;
using serving::LoopStats;
using serving::ServingError;
using serving::StepLatency;
using serving::SubmitError;

}  // namespace r3::server
