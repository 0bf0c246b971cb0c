// GET /metrics: Prometheus text exposition (format 0.0.4) of the engine and server counters.
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "server/serving_names.h"

namespace r3::server {

struct HttpCounters {
  std::map<std::pair<std::string, int>, uint64_t> responses;  // (endpoint, status) -> count
};

std::string prometheus_text(const LoopStats& s, const HttpCounters& http,
                            const std::string& model_name);

}  // namespace r3::server
