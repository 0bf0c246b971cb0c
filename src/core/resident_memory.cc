#include "core/resident_memory.h"

#include <unistd.h>

#include <fstream>

namespace r3 {

double resident_mb() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return double(resident) * double(sysconf(_SC_PAGESIZE)) / 1e6;
}

double physical_memory_mb() {
  return double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE)) / double(1 << 20);
}

}  // namespace r3
