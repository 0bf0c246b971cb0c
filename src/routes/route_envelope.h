// NeMo-RL's route envelope (NRLRE1): a route array as one string, the wire format NeMo-RL's
// rollout workers pass routes in (shared/INTEROP.md). Used by the server's `nrlre1` route format
// and by the staging side (r3.staging); it lives with the other route encodings.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "routes/route_array.h"

namespace r3 {

// NeMo-RL route envelope: "nrlre1:<int8|int16|int32>:<S>x<L>x<K>:<base64 of C-order bytes>",
// written with the narrowest signed type holding both the largest id and -1.
std::string encode_envelope(const RouteArray& r);
// Throws r3::Error on malformed input (also when an id does not fit RouteArray's int16).
RouteArray decode_envelope(const std::string& s);

// The same envelope over int32 ids, for vocabularies of experts past int16 (Megatron switches
// to int32 above 32767 experts). `ids` is [S, L, K] C order; ids must be >= -1.
struct EnvelopeIds {
  int s = 0, l = 0, k = 0;
  std::string dtype;          // "int8" | "int16" | "int32", as found in the envelope
  std::vector<int32_t> data;  // s * l * k
};
std::string encode_envelope(const std::vector<int32_t>& ids, int S, int L, int K);
EnvelopeIds decode_envelope_ids(const std::string& s);  // throws r3::Error on malformed input
// The narrowest signed dtype name holding both max_id and -1: "int8", "int16" or "int32".
const char* envelope_dtype_for(int64_t max_id);

}  // namespace r3
