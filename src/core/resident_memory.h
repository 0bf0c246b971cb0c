// This process's resident memory (RSS), from /proc/self/statm, and the machine's memory.
#pragma once

namespace r3 {

double resident_mb();

// The machine's physical memory in MiB.
double physical_memory_mb();

}  // namespace r3
