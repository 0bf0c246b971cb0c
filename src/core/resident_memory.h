// This process's resident memory (RSS), from /proc/self/statm.
#pragma once

namespace r3 {

double resident_mb();

}  // namespace r3
