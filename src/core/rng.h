// Counter-based random numbers: a value is a pure function of (key, counter), so sampling and
// weight initialisation are reproducible whatever the order of calls (DESIGN.md, numerics).
#pragma once
#include <cmath>
#include <cstdint>

namespace r3 {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t hash_pair(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b)); }

// Uniform in [0, 1) with 53 random bits.
inline double uniform01(uint64_t key, uint64_t counter) {
  return double(hash_pair(key, counter) >> 11) * 0x1.0p-53;
}

// Standard normal (Box-Muller on two counter-keyed uniforms).
inline float normal(uint64_t key, uint64_t counter) {
  double u1 = uniform01(key, 2 * counter), u2 = uniform01(key, 2 * counter + 1);
  if (u1 < 1e-300) u1 = 1e-300;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace r3
