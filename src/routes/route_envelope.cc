#include "routes/route_envelope.h"

#include <cstring>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace r3 {

namespace {

constexpr const char* kEnvelopeMagic = "nrlre1";

int dtype_width(const std::string& d) {
  if (d == "int8") return 1;
  if (d == "int16") return 2;
  if (d == "int32") return 4;
  return 0;
}

std::string encode_values(const int32_t* v, size_t n, int S, int L, int K) {
  if (S < 0 || L < 0 || K < 0) throw Error("encode_envelope: negative dimension");
  if (size_t(S) * size_t(L) * size_t(K) != n) {
    std::ostringstream o;
    o << "encode_envelope: shape " << S << "x" << L << "x" << K << " needs "
      << size_t(S) * size_t(L) * size_t(K) << " ids, found " << n;
    throw Error(o.str());
  }
  int64_t max_id = -1;
  for (size_t i = 0; i < n; ++i) {
    if (v[i] < -1) {
      std::ostringstream o;
      o << "encode_envelope: id " << v[i] << " at flat index " << i << " is below -1";
      throw Error(o.str());
    }
    max_id = std::max<int64_t>(max_id, v[i]);
  }
  const std::string dtype = envelope_dtype_for(max_id);
  const int w = dtype_width(dtype);
  std::vector<uint8_t> bytes(n * size_t(w));
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(v[i]);
    for (int b = 0; b < w; ++b) bytes[i * w + b] = uint8_t((u >> (8 * b)) & 0xFF);  // little-endian
  }
  std::ostringstream o;
  o << kEnvelopeMagic << ":" << dtype << ":" << S << "x" << L << "x" << K << ":"
    << base64_encode(bytes.data(), bytes.size());
  return o.str();
}

// A non-negative decimal without sign or leading zeros, at most INT32_MAX.
bool parse_dim(const std::string& s, int* out) {
  if (s.empty() || s.size() > 10) return false;
  if (s.size() > 1 && s[0] == '0') return false;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v > std::numeric_limits<int32_t>::max()) return false;
  *out = int(v);
  return true;
}

}  // namespace

const char* envelope_dtype_for(int64_t max_id) {
  if (max_id <= std::numeric_limits<int8_t>::max()) return "int8";
  if (max_id <= std::numeric_limits<int16_t>::max()) return "int16";
  if (max_id <= std::numeric_limits<int32_t>::max()) return "int32";
  throw Error("envelope: expert id " + std::to_string(max_id) + " does not fit int32");
}

std::string encode_envelope(const std::vector<int32_t>& ids, int S, int L, int K) {
  return encode_values(ids.data(), ids.size(), S, L, K);
}

std::string encode_envelope(const RouteArray& r) {
  std::vector<int32_t> v(r.data.begin(), r.data.end());
  if (r.rows < 0 || r.layers < 0 || r.k < 0 ||
      size_t(r.rows) * size_t(r.layers) * size_t(r.k) != r.data.size()) {
    std::ostringstream o;
    o << "encode_envelope: RouteArray shape [" << r.rows << ", " << r.layers << ", " << r.k
      << "] does not match its " << r.data.size() << " ids";
    throw Error(o.str());
  }
  return encode_values(v.data(), v.size(), r.rows, r.layers, r.k);
}

EnvelopeIds decode_envelope_ids(const std::string& s) {
  auto fail = [&](const std::string& why) -> Error {
    std::string shown = s.size() > 48 ? s.substr(0, 48) + "..." : s;
    return Error("decode_envelope: " + why + " (in \"" + shown + "\")");
  };
  // Exactly four ':'-separated fields (base64 never contains ':').
  std::vector<std::string> f;
  size_t pos = 0;
  while (true) {
    size_t c = s.find(':', pos);
    if (c == std::string::npos) {
      f.push_back(s.substr(pos));
      break;
    }
    f.push_back(s.substr(pos, c - pos));
    pos = c + 1;
  }
  if (f.size() != 4)
    throw fail("expected 4 ':'-separated fields nrlre1:<dtype>:<S>x<L>x<K>:<base64>, found " +
               std::to_string(f.size()));
  if (f[0] != kEnvelopeMagic) throw fail("unknown magic \"" + f[0] + "\", expected \"nrlre1\"");
  EnvelopeIds out;
  out.dtype = f[1];
  const int w = dtype_width(f[1]);
  if (w == 0) throw fail("unknown dtype \"" + f[1] + "\", expected int8, int16 or int32");
  // Shape.
  std::vector<std::string> d;
  pos = 0;
  while (true) {
    size_t c = f[2].find('x', pos);
    if (c == std::string::npos) {
      d.push_back(f[2].substr(pos));
      break;
    }
    d.push_back(f[2].substr(pos, c - pos));
    pos = c + 1;
  }
  if (d.size() != 3) throw fail("shape \"" + f[2] + "\" is not <S>x<L>x<K>");
  if (!parse_dim(d[0], &out.s) || !parse_dim(d[1], &out.l) || !parse_dim(d[2], &out.k))
    throw fail("shape \"" + f[2] + "\" has a dimension that is not a non-negative integer");
  uint64_t n = 0, nbytes = 0;
  if (__builtin_mul_overflow(uint64_t(out.s), uint64_t(out.l), &n) ||
      __builtin_mul_overflow(n, uint64_t(out.k), &n) ||
      __builtin_mul_overflow(n, uint64_t(w), &nbytes))
    throw fail("shape \"" + f[2] + "\" is too large");
  // Cheap length check before decoding: padded base64 of nbytes is 4*ceil(nbytes/3) chars.
  if (nbytes > (uint64_t(f[3].size()) / 4) * 3 + 3)
    throw fail("payload of " + std::to_string(f[3].size()) + " base64 chars is too short: shape " +
               f[2] + " of " + f[1] + " needs " + std::to_string(nbytes) + " bytes");
  std::vector<uint8_t> bytes;
  try {
    bytes = base64_decode(f[3]);
  } catch (const Error& e) {
    throw fail(std::string("bad base64 payload: ") + e.what());
  }
  if (bytes.size() != nbytes) {
    std::ostringstream o;
    o << "payload holds " << bytes.size() << " bytes, shape " << f[2] << " of " << f[1] << " needs "
      << nbytes;
    throw fail(o.str());
  }
  out.data.resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t u = 0;
    for (int b = 0; b < w; ++b) u |= uint32_t(bytes[i * w + b]) << (8 * b);
    int32_t v;
    if (w == 1)
      v = int8_t(uint8_t(u));
    else if (w == 2)
      v = int16_t(uint16_t(u));
    else
      v = int32_t(u);
    if (v < -1) {
      std::ostringstream o;
      o << "id " << v << " at flat index " << i << " is below -1";
      throw fail(o.str());
    }
    out.data[i] = v;
  }
  return out;
}

RouteArray decode_envelope(const std::string& s) {
  EnvelopeIds e = decode_envelope_ids(s);
  RouteArray r(e.s, e.l, e.k, int16_t(-1));
  for (size_t i = 0; i < e.data.size(); ++i) {
    if (e.data[i] > std::numeric_limits<int16_t>::max()) {
      std::ostringstream o;
      o << "decode_envelope: id " << e.data[i] << " at flat index " << i
        << " does not fit RouteArray's int16 (use decode_envelope_ids)";
      throw Error(o.str());
    }
    r.data[i] = int16_t(e.data[i]);
  }
  return r;
}

}  // namespace r3
