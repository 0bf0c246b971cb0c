#include "routes/route_array.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/error.h"

namespace r3 {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Base64 (RFC 4648 section 4, standard alphabet, with padding).

namespace {

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

std::string printable(unsigned char c) {
  if (c >= 0x20 && c < 0x7f) return std::string("'") + char(c) + "'";
  static const char* hex = "0123456789abcdef";
  return std::string("byte 0x") + hex[c >> 4] + hex[c & 15];
}

}  // namespace

std::string base64_encode(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= n; i += 3) {
    uint32_t v = uint32_t(p[i]) << 16 | uint32_t(p[i + 1]) << 8 | uint32_t(p[i + 2]);
    out.push_back(kB64[v >> 18]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(kB64[(v >> 6) & 63]);
    out.push_back(kB64[v & 63]);
  }
  if (n - i == 1) {
    uint32_t v = uint32_t(p[i]) << 16;
    out.push_back(kB64[v >> 18]);
    out.push_back(kB64[(v >> 12) & 63]);
    out += "==";
  } else if (n - i == 2) {
    uint32_t v = uint32_t(p[i]) << 16 | uint32_t(p[i + 1]) << 8;
    out.push_back(kB64[v >> 18]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(kB64[(v >> 6) & 63]);
    out.push_back('=');
  }
  return out;
}

std::vector<uint8_t> base64_decode(const std::string& s) {
  if (s.size() % 4 != 0)
    throw Error("base64: length " + std::to_string(s.size()) + " is not a multiple of 4");
  size_t pad = 0;  // at most two trailing '='; any other '=' is reported below
  while (pad < 2 && pad < s.size() && s[s.size() - 1 - pad] == '=') ++pad;
  std::vector<uint8_t> out;
  out.reserve(s.size() / 4 * 3);
  const size_t body = s.size() - pad;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < body; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int v = b64_value(c);
    if (v < 0) {
      if (c == '=')
        throw Error("base64: padding '=' at offset " + std::to_string(i) +
                    " before the end of the input");
      throw Error("base64: invalid character " + printable(c) + " at offset " + std::to_string(i));
    }
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
      acc &= (1u << bits) - 1;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// JSON transport.

namespace {

// Element count of [R, L, K] as bytes of int16, with overflow checks.
size_t route_bytes(uint64_t r, uint64_t l, uint64_t k, const std::string& where) {
  uint64_t n = 0;
  if (__builtin_mul_overflow(r, l, &n) || __builtin_mul_overflow(n, k, &n) ||
      __builtin_mul_overflow(n, uint64_t(2), &n) || n > uint64_t(SIZE_MAX))
    throw Error(where + ": shape [" + std::to_string(r) + ", " + std::to_string(l) + ", " +
                std::to_string(k) + "] is too large");
  return size_t(n);
}

// A non-negative integer that fits an int, or nullopt-like failure (returns false).
bool as_nonneg_int(const json& v, int& out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(INT_MAX)) return false;
    out = int(u);
    return true;
  }
  if (v.is_number_integer()) {
    int64_t s = v.get<int64_t>();
    if (s < 0 || s > int64_t(INT_MAX)) return false;
    out = int(s);
    return true;
  }
  return false;
}

}  // namespace

RouteIdType route_id_type(const RouteArray& r) {
  // The ids present always count too, so no type ever wraps an id (even one past the count).
  int lo = 0, hi = r.num_experts - 1;
  for (int16_t v : r.data) {
    lo = std::min<int>(lo, v);
    hi = std::max<int>(hi, v);
  }
  if (lo >= -1 && hi <= 127) return RouteIdType::Int8;
  if (lo >= 0 && hi <= 255) return RouteIdType::Uint8;
  return RouteIdType::Int16;
}

const char* route_id_type_name(RouteIdType t) {
  return t == RouteIdType::Int8 ? "int8" : t == RouteIdType::Uint8 ? "uint8" : "int16";
}

namespace {

size_t id_bytes(RouteIdType t) { return t == RouteIdType::Int16 ? 2 : 1; }

// The ids as little-endian bytes of type t (which route_id_type chose, so every id fits).
void append_ids(const RouteArray& r, RouteIdType t, std::string& out) {
  out.reserve(out.size() + r.data.size() * id_bytes(t));
  for (int16_t v : r.data) {
    const uint16_t u = uint16_t(v);
    out.push_back(char(u & 0xff));
    if (t == RouteIdType::Int16) out.push_back(char(u >> 8));
  }
}

// Ids read back from little-endian bytes of type t (n ids).
void read_ids(const uint8_t* d, size_t n, RouteIdType t, std::vector<int16_t>& out) {
  out.resize(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = t == RouteIdType::Int8    ? int16_t(int8_t(d[i]))
             : t == RouteIdType::Uint8 ? int16_t(d[i])
                                       : int16_t(uint16_t(d[2 * i]) | uint16_t(d[2 * i + 1]) << 8);
}

void check_shape(const RouteArray& r, const std::string& what) {
  const size_t n = size_t(r.rows) * size_t(r.layers) * size_t(r.k);
  if (r.rows < 0 || r.layers < 0 || r.k < 0 || r.data.size() != n)
    throw Error(what + ": data holds " + std::to_string(r.data.size()) + " values but shape [" +
                std::to_string(r.rows) + ", " + std::to_string(r.layers) + ", " +
                std::to_string(r.k) + "] needs " + std::to_string(n));
}

// A transport object's "shape": [R, L, K], 3 non-negative integers (throws naming the field).
void read_shape(const json& j, const std::string& where, int dims[3]) {
  if (!j.contains("shape")) throw Error(where + ": missing field \"shape\"");
  const json& shape = j.at("shape");
  if (!shape.is_array() || shape.size() != 3)
    throw Error(where + ": field \"shape\" must be [R, L, K] (3 non-negative integers), got " +
                shape.dump());
  for (size_t i = 0; i < 3; ++i)
    if (!as_nonneg_int(shape[i], dims[i]))
      throw Error(where + ": field \"shape\" must be [R, L, K] (3 non-negative integers), got " +
                  shape.dump());
}

// A transport object's "data": base64 of exactly the shape's count of `dtype` values of
// `value_bytes` each.
std::vector<uint8_t> read_data(const json& j, const std::string& where, const int dims[3],
                               const std::string& dtype, size_t value_bytes) {
  if (!j.contains("data")) throw Error(where + ": missing field \"data\"");
  const json& d = j.at("data");
  if (!d.is_string()) throw Error(where + ": field \"data\" must be a base64 string");
  // route_bytes counts 2-byte values (and refuses a shape too large before anything is decoded).
  const size_t need =
      route_bytes(uint64_t(dims[0]), uint64_t(dims[1]), uint64_t(dims[2]), where) / 2 * value_bytes;
  std::vector<uint8_t> bytes;
  try {
    bytes = base64_decode(d.get_ref<const std::string&>());
  } catch (const Error& e) {
    throw Error(where + ": field \"data\": " + e.what());
  }
  if (bytes.size() != need)
    throw Error(where + ": field \"data\" decodes to " + std::to_string(bytes.size()) +
                " bytes, shape [" + std::to_string(dims[0]) + ", " + std::to_string(dims[1]) +
                ", " + std::to_string(dims[2]) + "] of " + dtype + " needs " +
                std::to_string(need));
  return bytes;
}

// The weights' count against the ids' (a RouteArray with weights holds one per id).
void check_weights(const RouteArray& r, const std::string& what) {
  check_shape(r, what);
  if (r.weights.size() != r.data.size())
    throw Error(what + ": " + std::to_string(r.weights.size()) + " weights for " +
                std::to_string(r.data.size()) + " ids");
}

constexpr char kNpyMagic[] = "\x93NUMPY";

// An .npy file's first bytes for an array of r's shape in the numpy type `descr`: magic (6) +
// version (2) + header length (2) + dict + spaces + '\n', a multiple of 64.
std::string npy_header(const RouteArray& r, const char* descr) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" +
                     std::to_string(r.rows) + ", " + std::to_string(r.layers) + ", " +
                     std::to_string(r.k) + "), }";
  const size_t total = 10 + dict.size() + 1;
  const size_t padded = (total + 63) / 64 * 64;
  const std::string header = dict + std::string(padded - total, ' ') + "\n";
  std::string out;
  out.append(kNpyMagic, 6);
  out.push_back('\x01');
  out.push_back('\x00');
  out.push_back(char(header.size() & 0xff));
  out.push_back(char(header.size() >> 8));
  return out + header;
}

}  // namespace

void RouteArray::append(const RouteArray& more) {
  const bool both_weighted = has_weights() && more.has_weights();
  data.insert(data.end(), more.data.begin(), more.data.end());
  if (both_weighted)
    weights.insert(weights.end(), more.weights.begin(), more.weights.end());
  else
    weights.clear();
  rows += more.rows;
}

std::string float32_bytes(const std::vector<float>& w) {
  std::string out(w.size() * 4, '\0');
  for (size_t i = 0; i < w.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &w[i], 4);
    for (int b = 0; b < 4; ++b) out[4 * i + size_t(b)] = char(u >> (8 * b) & 0xff);
  }
  return out;
}

std::vector<float> floats_of_bytes(const std::vector<uint8_t>& bytes) {
  if (bytes.size() % 4)
    throw Error("float32 data of " + std::to_string(bytes.size()) + " bytes (not a multiple of 4)");
  std::vector<float> out(bytes.size() / 4);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint8_t* d = bytes.data() + 4 * i;
    const uint32_t u =
        uint32_t(d[0]) | uint32_t(d[1]) << 8 | uint32_t(d[2]) << 16 | uint32_t(d[3]) << 24;
    std::memcpy(&out[i], &u, 4);
  }
  return out;
}

json route_weights_to_json(const RouteArray& r) {
  check_weights(r, "route_weights_to_json");
  const std::string bytes = float32_bytes(r.weights);
  json j;
  j["shape"] = {r.rows, r.layers, r.k};
  j["dtype"] = "float32";
  j["start"] = r.start;
  j["moe_layers"] = r.moe_layers;
  j["data"] = base64_encode(bytes.data(), bytes.size());
  return j;
}

std::vector<float> route_weights_from_json(const json& j) {
  const std::string where = "route weights JSON";
  if (!j.is_object()) throw Error(where + ": expected an object with shape, dtype and data");
  int dims[3] = {0, 0, 0};
  read_shape(j, where, dims);
  if (j.value("dtype", json()).dump() != "\"float32\"")
    throw Error(where + ": field \"dtype\" must be \"float32\", got " +
                j.value("dtype", json()).dump());
  return floats_of_bytes(read_data(j, where, dims, "float32", 4));
}

json routes_to_json(const RouteArray& r) {
  check_shape(r, "routes_to_json");
  const RouteIdType t = route_id_type(r);
  std::string bytes;
  append_ids(r, t, bytes);
  json j;
  j["shape"] = {r.rows, r.layers, r.k};
  j["dtype"] = route_id_type_name(t);
  j["start"] = r.start;
  j["moe_layers"] = r.moe_layers;
  j["data"] = base64_encode(bytes.data(), bytes.size());
  return j;
}

RouteArray routes_from_json(const json& j) {
  const std::string where = "routes JSON";
  if (!j.is_object()) throw Error(where + ": expected an object with shape, dtype and data");

  int dims[3] = {0, 0, 0};
  read_shape(j, where, dims);

  if (!j.contains("dtype")) throw Error(where + ": missing field \"dtype\"");
  const json& dt = j.at("dtype");
  const std::string dtype = dt.is_string() ? dt.get<std::string>() : "";
  if (dtype != "int8" && dtype != "uint8" && dtype != "int16")
    throw Error(where + ": field \"dtype\" must be \"int8\", \"uint8\" or \"int16\", got " +
                dt.dump());
  const RouteIdType type = dtype == "int8"    ? RouteIdType::Int8
                           : dtype == "uint8" ? RouteIdType::Uint8
                                              : RouteIdType::Int16;

  RouteArray r;
  r.rows = dims[0];
  r.layers = dims[1];
  r.k = dims[2];

  if (j.contains("start") && !j.at("start").is_null()) {
    if (!as_nonneg_int(j.at("start"), r.start))
      throw Error(where + ": field \"start\" must be a non-negative integer, got " +
                  j.at("start").dump());
  }
  if (j.contains("moe_layers") && !j.at("moe_layers").is_null()) {
    const json& ml = j.at("moe_layers");
    if (!ml.is_array())
      throw Error(where + ": field \"moe_layers\" must be a list of non-negative integers");
    for (auto& v : ml) {
      int x = 0;
      if (!as_nonneg_int(v, x))
        throw Error(where + ": field \"moe_layers\" must be a list of non-negative integers, got " +
                    ml.dump());
      r.moe_layers.push_back(x);
    }
    if (!r.moe_layers.empty() && int64_t(r.moe_layers.size()) != int64_t(r.layers))
      throw Error(where + ": field \"moe_layers\" names " + std::to_string(r.moe_layers.size()) +
                  " layers but shape has L = " + std::to_string(r.layers));
  }

  const std::vector<uint8_t> bytes = read_data(j, where, dims, dtype, id_bytes(type));
  read_ids(bytes.data(), bytes.size() / id_bytes(type), type, r.data);
  return r;
}

// ---------------------------------------------------------------------------------------------
// .npy

namespace {

// A tiny parser for the Python-literal dict of an .npy header.
struct NpyHeaderParser {
  const std::string& s;
  const std::string& path;
  size_t i = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(path + ": malformed .npy header (" + what + "): " + s);
  }
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  }
  bool peek(char c) {
    ws();
    return i < s.size() && s[i] == c;
  }
  void expect(char c) {
    if (!peek(c)) fail(std::string("expected '") + c + "'");
    ++i;
  }
  std::string str() {
    ws();
    if (i >= s.size() || (s[i] != '\'' && s[i] != '"')) fail("expected a string");
    char q = s[i++];
    size_t b = i;
    while (i < s.size() && s[i] != q) ++i;
    if (i >= s.size()) fail("unterminated string");
    return s.substr(b, i++ - b);
  }
  bool boolean() {
    ws();
    if (s.compare(i, 4, "True") == 0) {
      i += 4;
      return true;
    }
    if (s.compare(i, 5, "False") == 0) {
      i += 5;
      return false;
    }
    fail("expected True or False");
  }
  uint64_t integer() {
    ws();
    if (i >= s.size() || s[i] < '0' || s[i] > '9') fail("expected a non-negative integer");
    uint64_t v = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      if (__builtin_mul_overflow(v, uint64_t(10), &v) ||
          __builtin_add_overflow(v, uint64_t(s[i] - '0'), &v))
        fail("integer too large");
      ++i;
    }
    if (i < s.size() && s[i] == 'L') ++i;  // Python 2 long suffix
    return v;
  }
  std::vector<uint64_t> tuple() {
    expect('(');
    std::vector<uint64_t> out;
    while (!peek(')')) {
      out.push_back(integer());
      if (peek(','))
        ++i;
      else if (!peek(')'))
        fail("expected ',' or ')' in shape");
    }
    ++i;
    return out;
  }
};

}  // namespace

std::string npy_bytes(const RouteArray& r, const std::string& path) {
  check_shape(r, path + ": cannot write .npy");
  const RouteIdType t = route_id_type(r);
  std::string out = npy_header(r, t == RouteIdType::Int8    ? "|i1"
                                  : t == RouteIdType::Uint8 ? "|u1"
                                                            : "<i2");
  append_ids(r, t, out);
  return out;
}

std::string npy_weight_bytes(const RouteArray& r) {
  check_weights(r, "npy_weight_bytes");
  return npy_header(r, "<f4") + float32_bytes(r.weights);
}

void write_npy(const std::string& path, const RouteArray& r) {
  const std::string out = npy_bytes(r, path);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw Error(path + ": cannot open for writing");
  f.write(out.data(), std::streamsize(out.size()));
  f.close();
  if (!f) throw Error(path + ": write failed");
}

RouteArray read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot open .npy file");
  std::string buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw Error(path + ": read failed");
  return parse_npy(buf, path);
}

RouteArray parse_npy(const std::string& buf, const std::string& path) {
  if (buf.size() < 10 || buf.compare(0, 6, kNpyMagic, 6) != 0)
    throw Error(path + ": not an .npy file (bad magic)");
  const unsigned major = uint8_t(buf[6]);
  size_t hlen = 0, hstart = 0;
  if (major == 1) {
    hlen = size_t(uint8_t(buf[8])) | size_t(uint8_t(buf[9])) << 8;
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (buf.size() < 12) throw Error(path + ": truncated .npy header");
    hlen = size_t(uint8_t(buf[8])) | size_t(uint8_t(buf[9])) << 8 | size_t(uint8_t(buf[10])) << 16 |
           size_t(uint8_t(buf[11])) << 24;
    hstart = 12;
  } else {
    throw Error(path + ": unsupported .npy format version " + std::to_string(major));
  }
  if (hlen > buf.size() - hstart)
    throw Error(path + ": .npy header length " + std::to_string(hlen) +
                " runs past the end of the file (" + std::to_string(buf.size()) + " bytes)");
  const std::string header = buf.substr(hstart, hlen);

  NpyHeaderParser p{header, path};
  std::string descr;
  bool have_descr = false, have_order = false, have_shape = false, fortran = false;
  std::vector<uint64_t> shape;
  p.expect('{');
  while (!p.peek('}')) {
    std::string key = p.str();
    p.expect(':');
    if (key == "descr") {
      descr = p.str();
      have_descr = true;
    } else if (key == "fortran_order") {
      fortran = p.boolean();
      have_order = true;
    } else if (key == "shape") {
      shape = p.tuple();
      have_shape = true;
    } else {
      p.fail("unexpected key '" + key + "'");
    }
    if (p.peek(','))
      ++p.i;
    else if (!p.peek('}'))
      p.fail("expected ',' or '}'");
  }
  if (!have_descr || !have_order || !have_shape)
    p.fail("needs the keys 'descr', 'fortran_order' and 'shape'");

  size_t itemsize = 0;
  const bool unsigned_bytes = descr == "<u1" || descr == "|u1" || descr == "u1";
  if (descr == "<i1" || descr == "|i1" || descr == "i1" || unsigned_bytes)
    itemsize = 1;
  else if (descr == "<i2")
    itemsize = 2;
  else if (descr == "<i4")
    itemsize = 4;
  else
    throw Error(path + ": .npy dtype '" + descr +
                "' is not supported (routes are i1, u1, <i2 or <i4)");
  if (fortran) throw Error(path + ": .npy array is in Fortran order; routes need C order");
  if (shape.size() != 3)
    throw Error(path + ": .npy array has rank " + std::to_string(shape.size()) +
                ", routes need rank 3 [R, L, K]");
  for (uint64_t d : shape)
    if (d > uint64_t(INT_MAX))
      throw Error(path + ": .npy shape dimension " + std::to_string(d) + " is too large");
  uint64_t count = 0, nbytes = 0;
  if (__builtin_mul_overflow(shape[0], shape[1], &count) ||
      __builtin_mul_overflow(count, shape[2], &count) ||
      __builtin_mul_overflow(count, uint64_t(itemsize), &nbytes))
    throw Error(path + ": .npy shape is too large");
  const size_t data_at = hstart + hlen;
  const uint64_t have = buf.size() - data_at;
  if (have != nbytes)
    throw Error(path + ": .npy data is " + std::to_string(have) + " bytes but shape (" +
                std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " +
                std::to_string(shape[2]) + ") of " + descr + " needs " + std::to_string(nbytes) +
                (have < nbytes ? " (truncated file)" : " (trailing bytes)"));

  RouteArray r;
  r.rows = int(shape[0]);
  r.layers = int(shape[1]);
  r.k = int(shape[2]);
  r.data.resize(size_t(count));
  const uint8_t* d = reinterpret_cast<const uint8_t*>(buf.data() + data_at);
  for (size_t i = 0; i < size_t(count); ++i) {
    if (itemsize == 1) {
      r.data[i] = unsigned_bytes ? int16_t(d[i]) : int16_t(int8_t(d[i]));
    } else if (itemsize == 2) {
      r.data[i] = int16_t(uint16_t(d[2 * i]) | uint16_t(d[2 * i + 1]) << 8);
    } else {
      int32_t v = int32_t(uint32_t(d[4 * i]) | uint32_t(d[4 * i + 1]) << 8 |
                          uint32_t(d[4 * i + 2]) << 16 | uint32_t(d[4 * i + 3]) << 24);
      if (v < INT16_MIN || v > INT16_MAX)
        throw Error(path + ": .npy value " + std::to_string(v) + " at flat index " +
                    std::to_string(i) + " does not fit int16 routes");
      r.data[i] = int16_t(v);
    }
  }
  return r;
}

}  // namespace r3
