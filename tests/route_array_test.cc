// RouteArray transport: base64, JSON and .npy round trips, and every rejected input.
#include "routes/route_array.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "core/error.h"
#include "routes/route_formats.h"

namespace r3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Runs `f`, expects an r3::Error whose message contains every string in `parts`.
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected r3::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected r3::Error, nothing was thrown";
}

std::string tmp_path(const std::string& tag) {
  static std::atomic<int> counter{0};
  return (fs::temp_directory_path() / ("r3_route_array_test_" + std::to_string(::getpid()) + "_" +
                                       std::to_string(counter++) + "_" + tag))
      .string();
}

struct TmpFile {
  std::string path;
  explicit TmpFile(const std::string& tag) : path(tmp_path(tag)) {}
  ~TmpFile() { std::remove(path.c_str()); }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

RouteArray sample(int r, int l, int k) {
  RouteArray a(r, l, k);
  for (size_t i = 0; i < a.data.size(); ++i) a.data[i] = int16_t(int(i * 7919 % 65536) - 32768);
  if (!a.data.empty()) a.data[0] = -1;
  if (a.data.size() > 1) a.data[1] = 32767;
  a.start = 5;
  for (int i = 0; i < l; ++i) a.moe_layers.push_back(2 * i + 1);
  return a;
}

void expect_same(const RouteArray& a, const RouteArray& b) {
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.data, b.data);
}

// An .npy file with the given header dict text (padded like numpy does) and raw data.
std::string npy_bytes(const std::string& dict, const std::string& data, int major = 1) {
  std::string out = "\x93NUMPY";
  out.push_back(char(major));
  out.push_back('\0');
  const size_t len_bytes = major == 1 ? 2 : 4;
  size_t total = 6 + 2 + len_bytes + dict.size() + 1;
  std::string header = dict + std::string((total + 63) / 64 * 64 - total, ' ') + "\n";
  for (size_t i = 0; i < len_bytes; ++i) out.push_back(char((header.size() >> (8 * i)) & 0xff));
  return out + header + data;
}

// ------------------------------------------------------------------------------- base64

TEST(RouteArrayBase64, Rfc4648Vectors) {
  const std::pair<std::string, std::string> v[] = {{"", ""},
                                                   {"f", "Zg=="},
                                                   {"fo", "Zm8="},
                                                   {"foo", "Zm9v"},
                                                   {"foob", "Zm9vYg=="},
                                                   {"fooba", "Zm9vYmE="},
                                                   {"foobar", "Zm9vYmFy"}};
  for (auto& [plain, enc] : v) {
    EXPECT_EQ(base64_encode(plain.data(), plain.size()), enc);
    auto d = base64_decode(enc);
    EXPECT_EQ(std::string(d.begin(), d.end()), plain);
  }
}

TEST(RouteArrayBase64, RoundTripAllBytesAndLengths) {
  std::vector<uint8_t> all(256);
  for (int i = 0; i < 256; ++i) all[size_t(i)] = uint8_t(i);
  for (size_t n = 0; n <= all.size(); ++n) {
    std::string e = base64_encode(all.data(), n);
    EXPECT_EQ(e.size(), (n + 2) / 3 * 4);
    auto d = base64_decode(e);
    ASSERT_EQ(d.size(), n);
    EXPECT_TRUE(std::equal(d.begin(), d.end(), all.begin()));
  }
  std::string e = base64_encode(all.data(), all.size());
  EXPECT_NE(e.find('+'), std::string::npos);
  EXPECT_NE(e.find('/'), std::string::npos);
}

TEST(RouteArrayBase64, RejectsBadLength) {
  for (std::string s : {"A", "AB", "ABC", "ABCDE", "Zm9vYg="})
    expect_error([&] { base64_decode(s); }, {"base64", "length", "multiple of 4"});
}

TEST(RouteArrayBase64, RejectsBadCharacters) {
  expect_error([] { base64_decode("Zm9v!mFy"); },
               {"base64", "invalid character", "'!'", "offset 4"});
  expect_error([] { base64_decode("Zm9-YmFy"); }, {"invalid character", "'-'"});  // base64url
  expect_error([] { base64_decode("Zm9_YmFy"); }, {"invalid character", "'_'"});
  expect_error([] { base64_decode("Zm9v\nmFy"); }, {"invalid character", "0x0a"});
  expect_error([] { base64_decode(std::string("Zm9v\0mFy", 8)); }, {"invalid character", "0x00"});
  expect_error([] { base64_decode("Zm9v\xffmFy"); }, {"invalid character", "0xff"});
}

TEST(RouteArrayBase64, RejectsMisplacedPadding) {
  expect_error([] { base64_decode("Zg=a"); }, {"padding", "offset 2"});
  expect_error([] { base64_decode("Z==="); }, {"padding", "offset 1"});
  expect_error([] { base64_decode("===="); }, {"padding", "offset 0"});
  expect_error([] { base64_decode("Zg==Zg=="); }, {"padding", "offset 2"});
}

// ------------------------------------------------------------------------------- JSON

TEST(RouteArrayJson, RoundTrip) {
  RouteArray a = sample(5, 3, 4);
  json j = routes_to_json(a);
  EXPECT_EQ(j["shape"], json::array({5, 3, 4}));
  EXPECT_EQ(j["dtype"], "int16");  // ids from -32768 to 32767
  EXPECT_EQ(j["start"], 5);
  EXPECT_EQ(j["moe_layers"], json::array({1, 3, 5}));
  EXPECT_EQ(j["data"].get<std::string>().size(), (5u * 3 * 4 * 2 + 2) / 3 * 4);
  // Through text, as the transport does.
  RouteArray b = routes_from_json(json::parse(j.dump()));
  expect_same(a, b);
  EXPECT_EQ(b.start, 5);
  EXPECT_EQ(b.moe_layers, a.moe_layers);
}

TEST(RouteArrayJson, LittleEndianInt16) {
  RouteArray a(1, 1, 2);
  a.data = {-1, 0x0102};
  json j = routes_to_json(a);
  auto bytes = base64_decode(j["data"].get<std::string>());
  EXPECT_EQ(bytes, (std::vector<uint8_t>{0xff, 0xff, 0x02, 0x01}));
}

TEST(RouteArrayJson, EmptyArrays) {
  for (auto [r, l, k] : {std::tuple{0, 3, 4}, std::tuple{2, 0, 4}, std::tuple{0, 0, 0}}) {
    RouteArray a(r, l, k);
    RouteArray b = routes_from_json(routes_to_json(a));
    expect_same(a, b);
  }
}

TEST(RouteArrayJson, StartAndMoeLayersOptional) {
  RouteArray a = sample(2, 2, 2);
  json j = routes_to_json(a);
  j.erase("start");
  j.erase("moe_layers");
  RouteArray b = routes_from_json(j);
  expect_same(a, b);
  EXPECT_EQ(b.start, 0);
  EXPECT_TRUE(b.moe_layers.empty());
  j["start"] = nullptr;
  j["moe_layers"] = nullptr;
  EXPECT_NO_THROW(routes_from_json(j));
  j["moe_layers"] = json::array();
  EXPECT_NO_THROW(routes_from_json(j));
}

TEST(RouteArrayJson, RejectsNonObject) {
  expect_error([] { routes_from_json(json::array({1, 2})); }, {"routes JSON", "object"});
  expect_error([] { routes_from_json(json("x")); }, {"routes JSON", "object"});
}

TEST(RouteArrayJson, RejectsBadShape) {
  json good = routes_to_json(sample(2, 2, 2));
  expect_error(
      [&] {
        json j = good;
        j.erase("shape");
        routes_from_json(j);
      },
      {"\"shape\"", "missing"});
  for (json bad : {json(4), json::array({2, 2}), json::array({2, 2, 2, 1}), json::array({2, -1, 2}),
                   json::array({2, 2.5, 2}), json::array({2, "2", 2}), json::array({2, nullptr, 2}),
                   json::array({2, 2, 3000000000LL})}) {
    json j = good;
    j["shape"] = bad;
    expect_error([&] { routes_from_json(j); }, {"\"shape\"", "non-negative"});
  }
}

TEST(RouteArrayJson, RejectsBadDtype) {
  json good = routes_to_json(sample(2, 2, 2));
  expect_error(
      [&] {
        json j = good;
        j.erase("dtype");
        routes_from_json(j);
      },
      {"\"dtype\"", "missing"});
  for (json bad : {json("int32"), json("uint16"), json("<i2"), json(16)}) {
    json j = good;
    j["dtype"] = bad;
    expect_error([&] { routes_from_json(j); }, {"\"dtype\"", "int8", "uint8", "int16"});
  }
  json j = good;  // a dtype the data's length does not fit is caught by the byte count
  j["dtype"] = "int8";
  expect_error([&] { routes_from_json(j); }, {"\"data\"", "of int8 needs"});
}

// The wire id type is the narrowest the expert count allows (by the ids present when the count
// is unknown), stated in the payload, and every width round-trips through the transport JSON
// and .npy: 128 experts int8, 256 uint8 (int16 when a -1 row is present), 512 int16; the ids a
// narrower type would have wrapped (prime-rl #3051's uint8 at 512 experts) come back intact.
TEST(RouteArrayWidth, NarrowestTypeByExpertCountRoundTrips) {
  struct Case {
    int experts;
    bool minus_one;
    const char* dtype;
    const char* descr;
  };
  std::mt19937 rng(512);
  for (const Case& c : {Case{128, false, "int8", "|i1"}, Case{128, true, "int8", "|i1"},
                        Case{256, false, "uint8", "|u1"}, Case{256, true, "int16", "<i2"},
                        Case{512, false, "int16", "<i2"}, Case{0, false, "int8", "|i1"}}) {
    for (int k : {10, 22}) {
      RouteArray a(7, 3, k);
      a.num_experts = c.experts;
      const int E = c.experts ? c.experts : 100;  // unknown count: ids up to 99 fit int8
      for (int16_t& v : a.data) v = int16_t(std::uniform_int_distribution<int>(0, E - 1)(rng));
      a.data[0] = int16_t(E - 1);
      if (c.minus_one) a.data[1] = -1;
      SCOPED_TRACE(std::to_string(c.experts) + " experts, top-" + std::to_string(k));
      const json j = routes_to_json(a);
      EXPECT_EQ(j["dtype"], c.dtype);
      EXPECT_EQ(routes_from_json(json::parse(j.dump())).data, a.data);
      const std::string npy = npy_bytes(a);
      EXPECT_NE(npy.find(std::string("'descr': '") + c.descr + "'"), std::string::npos);
      EXPECT_EQ(parse_npy(npy).data, a.data);
    }
  }
}

TEST(RouteArrayJson, RejectsBadData) {
  json good = routes_to_json(sample(2, 2, 2));  // 16 bytes
  expect_error(
      [&] {
        json j = good;
        j.erase("data");
        routes_from_json(j);
      },
      {"\"data\"", "missing"});
  expect_error(
      [&] {
        json j = good;
        j["data"] = 5;
        routes_from_json(j);
      },
      {"\"data\"", "base64"});
  expect_error(
      [&] {
        json j = good;
        j["data"] = json::array({1});
        routes_from_json(j);
      },
      {"\"data\"", "base64"});
  expect_error(
      [&] {
        json j = good;
        j["data"] = "!!!!";
        routes_from_json(j);
      },
      {"\"data\"", "invalid character"});
  expect_error(
      [&] {
        json j = good;
        j["data"] = "AAA";
        routes_from_json(j);
      },
      {"\"data\"", "multiple of 4"});
  // Byte count must be R*L*K*2: one byte short, one element short, one element too many.
  std::vector<uint8_t> b(15, 0);
  expect_error(
      [&] {
        json j = good;
        j["data"] = base64_encode(b.data(), 15);
        routes_from_json(j);
      },
      {"\"data\"", "15 bytes", "needs 16"});
  b.resize(18);
  expect_error(
      [&] {
        json j = good;
        j["data"] = base64_encode(b.data(), 14);
        routes_from_json(j);
      },
      {"\"data\"", "14 bytes", "needs 16"});
  expect_error(
      [&] {
        json j = good;
        j["data"] = base64_encode(b.data(), 18);
        routes_from_json(j);
      },
      {"\"data\"", "18 bytes", "needs 16"});
}

TEST(RouteArrayJson, RejectsHugeShapeWithoutAllocating) {
  json j = routes_to_json(sample(2, 2, 2));
  j["shape"] = json::array({2000000000, 2000000000, 2000000000});
  expect_error([&] { routes_from_json(j); }, {"routes JSON"});
}

TEST(RouteArrayJson, RejectsBadStart) {
  json good = routes_to_json(sample(2, 2, 2));
  for (json bad : {json(-1), json(1.5), json("3"), json::array({1})}) {
    json j = good;
    j["start"] = bad;
    expect_error([&] { routes_from_json(j); }, {"\"start\"", "non-negative"});
  }
}

TEST(RouteArrayJson, RejectsBadMoeLayers) {
  json good = routes_to_json(sample(2, 2, 2));
  for (json bad : {json(1), json::array({1, -2}), json::array({1, "x"}), json::array({1.5, 2})}) {
    json j = good;
    j["moe_layers"] = bad;
    expect_error([&] { routes_from_json(j); }, {"\"moe_layers\""});
  }
  json j = good;
  j["moe_layers"] = json::array({1, 2, 3});
  expect_error([&] { routes_from_json(j); }, {"\"moe_layers\"", "3 layers", "L = 2"});
}

TEST(RouteArrayJson, ToJsonRejectsInconsistentArray) {
  RouteArray a(2, 2, 2);
  a.data.pop_back();
  expect_error([&] { routes_to_json(a); }, {"routes_to_json", "7 values"});
}

// ------------------------------------------------------------------------------- .npy

TEST(RouteArrayNpy, RoundTrip) {
  TmpFile f("rt.npy");
  RouteArray a = sample(7, 3, 2);
  write_npy(f.path, a);
  RouteArray b = read_npy(f.path);
  expect_same(a, b);
  EXPECT_EQ(b.start, 0);  // .npy carries only the array
}

TEST(RouteArrayNpy, EmptyRoundTrip) {
  TmpFile f("empty.npy");
  RouteArray a(0, 4, 8);
  write_npy(f.path, a);
  expect_same(a, read_npy(f.path));
}

TEST(RouteArrayNpy, HeaderFormat) {
  TmpFile f("hdr.npy");
  RouteArray a(3, 2, 1);
  a.data = {-1, 1, 2, 3, 258, -32768};
  write_npy(f.path, a);
  std::string s = read_bytes(f.path);
  ASSERT_GE(s.size(), 10u);
  EXPECT_EQ(s.substr(0, 6), "\x93NUMPY");
  EXPECT_EQ(s[6], '\x01');
  EXPECT_EQ(s[7], '\x00');
  size_t hlen = size_t(uint8_t(s[8])) | size_t(uint8_t(s[9])) << 8;
  EXPECT_EQ((10 + hlen) % 64, 0u);
  std::string header = s.substr(10, hlen);
  EXPECT_EQ(header.rfind("{'descr': '<i2', 'fortran_order': False, 'shape': (3, 2, 1), }", 0), 0u)
      << header;
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(header.find_first_not_of(' ', header.find('}') + 1), hlen - 1);
  ASSERT_EQ(s.size(), 10 + hlen + 12);
  EXPECT_EQ(s.substr(10 + hlen),
            std::string("\xff\xff\x01\x00\x02\x00\x03\x00\x02\x01\x00\x80", 12));
}

TEST(RouteArrayNpy, HeaderMultipleOf64ForManySizes) {
  for (int r : {0, 1, 9, 10, 99999, 1234567890}) {
    TmpFile f("sz.npy");
    RouteArray a(r, 0, 8);  // no data: only the digits of the shape vary
    write_npy(f.path, a);
    std::string s = read_bytes(f.path);
    size_t hlen = size_t(uint8_t(s[8])) | size_t(uint8_t(s[9])) << 8;
    EXPECT_EQ((10 + hlen) % 64, 0u);
  }
}

TEST(RouteArrayNpy, ReadsInt8AndInt32) {
  TmpFile f("i.npy");
  // int8: numpy writes '|i1'; accept '<i1' too.
  std::string d8 = std::string("\xff\x00\x05\x7f\x80\x01", 6);
  for (std::string descr : {"|i1", "<i1"}) {
    write_bytes(
        f.path,
        npy_bytes("{'descr': '" + descr + "', 'fortran_order': False, 'shape': (1, 3, 2), }", d8));
    RouteArray r = read_npy(f.path);
    EXPECT_EQ(r.rows, 1);
    EXPECT_EQ(r.layers, 3);
    EXPECT_EQ(r.k, 2);
    EXPECT_EQ(r.data, (std::vector<int16_t>{-1, 0, 5, 127, -128, 1}));
  }
  std::string d32;
  for (int32_t v : {-1, 7, 32767, -32768}) {
    for (int i = 0; i < 4; ++i) d32.push_back(char((uint32_t(v) >> (8 * i)) & 0xff));
  }
  write_bytes(f.path,
              npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 1, 2), }", d32));
  RouteArray r = read_npy(f.path);
  EXPECT_EQ(r.data, (std::vector<int16_t>{-1, 7, 32767, -32768}));
}

TEST(RouteArrayNpy, ReadsOtherHeaderSpellings) {
  TmpFile f("spell.npy");
  std::string d = std::string("\x01\x00\x02\x00", 4);
  // Keys in another order, double quotes, no trailing comma, version 2.0 header.
  write_bytes(
      f.path,
      npy_bytes("{\"shape\": (1,1,2), \"fortran_order\": False, \"descr\": \"<i2\"}", d, 2));
  RouteArray r = read_npy(f.path);
  EXPECT_EQ(r.data, (std::vector<int16_t>{1, 2}));
}

TEST(RouteArrayNpy, RejectsInt32OutOfRange) {
  TmpFile f("big.npy");
  std::string d32("\x00\x80\x00\x00", 4);  // 32768
  write_bytes(f.path,
              npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (1, 1, 1), }", d32));
  expect_error([&] { read_npy(f.path); }, {f.path, "32768", "int16"});
}

TEST(RouteArrayNpy, RejectsMissingFile) {
  std::string p = tmp_path("does_not_exist.npy");
  expect_error([&] { read_npy(p); }, {p, "cannot open"});
}

TEST(RouteArrayNpy, RejectsBadMagicAndVersion) {
  TmpFile f("magic.npy");
  write_bytes(f.path, "PK\x03\x04 this is a zip");
  expect_error([&] { read_npy(f.path); }, {f.path, "magic"});
  write_bytes(f.path, "\x93NUM");
  expect_error([&] { read_npy(f.path); }, {f.path, "magic"});
  write_bytes(f.path, "");
  expect_error([&] { read_npy(f.path); }, {f.path});
  std::string s =
      npy_bytes("{'descr': '<i2', 'fortran_order': False, 'shape': (1, 1, 1), }", "\0\0");
  s[6] = 9;
  write_bytes(f.path, s);
  expect_error([&] { read_npy(f.path); }, {f.path, "version 9"});
}

TEST(RouteArrayNpy, RejectsHeaderPastEnd) {
  TmpFile f("hdrlen.npy");
  std::string s = npy_bytes("{'descr': '<i2', 'fortran_order': False, 'shape': (1, 1, 1), }", "");
  s[8] = char(0xff);
  s[9] = char(0x7f);
  write_bytes(f.path, s);
  expect_error([&] { read_npy(f.path); }, {f.path, "header length", "past the end"});
}

TEST(RouteArrayNpy, RejectsUnsupportedDtype) {
  TmpFile f("dtype.npy");
  for (std::string descr : {"<f4", ">i2", "<i8", "<u2", "|b1"}) {
    write_bytes(f.path, npy_bytes("{'descr': '" + descr +
                                      "', 'fortran_order': False, 'shape': (1, 1, 1), }",
                                  std::string(8, '\0')));
    expect_error([&] { read_npy(f.path); }, {f.path, descr, "not supported"});
  }
}

TEST(RouteArrayNpy, RejectsFortranOrder) {
  TmpFile f("fortran.npy");
  write_bytes(f.path, npy_bytes("{'descr': '<i2', 'fortran_order': True, 'shape': (1, 2, 1), }",
                                std::string(4, '\0')));
  expect_error([&] { read_npy(f.path); }, {f.path, "Fortran"});
}

TEST(RouteArrayNpy, RejectsWrongRank) {
  TmpFile f("rank.npy");
  write_bytes(f.path, npy_bytes("{'descr': '<i2', 'fortran_order': False, 'shape': (2, 2), }",
                                std::string(8, '\0')));
  expect_error([&] { read_npy(f.path); }, {f.path, "rank 2"});
  write_bytes(f.path, npy_bytes("{'descr': '<i2', 'fortran_order': False, 'shape': (1, 1, 1, 2), }",
                                std::string(4, '\0')));
  expect_error([&] { read_npy(f.path); }, {f.path, "rank 4"});
  write_bytes(f.path, npy_bytes("{'descr': '<i2', 'fortran_order': False, 'shape': (), }",
                                std::string(2, '\0')));
  expect_error([&] { read_npy(f.path); }, {f.path, "rank 0"});
}

TEST(RouteArrayNpy, RejectsWrongFileSize) {
  TmpFile f("size.npy");
  RouteArray a = sample(4, 2, 2);
  write_npy(f.path, a);
  std::string s = read_bytes(f.path);
  write_bytes(f.path, s.substr(0, s.size() - 1));
  expect_error([&] { read_npy(f.path); }, {f.path, "31 bytes", "needs 32", "truncated"});
  write_bytes(f.path, s + "xx");
  expect_error([&] { read_npy(f.path); }, {f.path, "34 bytes", "needs 32", "trailing"});
}

TEST(RouteArrayNpy, RejectsMalformedHeaders) {
  TmpFile f("malformed.npy");
  const std::string d(2, '\0');
  for (std::string dict : {
           "['descr', '<i2']",
           "{'descr': '<i2', 'fortran_order': False}",                              // no shape
           "{'descr': '<i2', 'fortran_order': False, 'shape': (1, 1, 1), 'x': 1}",  // extra key
           "{'descr': '<i2', 'fortran_order': Maybe, 'shape': (1, 1, 1), }",
           "{'descr': '<i2', 'fortran_order': False, 'shape': (1, -1, 1), }",
           "{'descr': '<i2', 'fortran_order': False, 'shape': (1 1 1), }",
           "{'descr': '<i2', 'fortran_order': False, 'shape': (1, 1, 1), ",
           "{'descr: '<i2', 'fortran_order': False, 'shape': (1, 1, 1), }",
           "{'descr': '<i2' 'fortran_order': False, 'shape': (1, 1, 1), }",
           "{'descr': '<i2', 'fortran_order': False, 'shape': (99999999999999999999999, 1, 1), }",
       }) {
    write_bytes(f.path, npy_bytes(dict, d));
    expect_error([&] { read_npy(f.path); }, {f.path});
  }
}

TEST(RouteArrayNpy, RejectsHugeShape) {
  TmpFile f("huge.npy");
  write_bytes(f.path, npy_bytes("{'descr': '<i2', 'fortran_order': False, 'shape': (2000000000, "
                                "2000000000, 2000000000), }",
                                ""));
  expect_error([&] { read_npy(f.path); }, {f.path});
  write_bytes(
      f.path,
      npy_bytes("{'descr': '<i2', 'fortran_order': False, 'shape': (3000000000, 1, 1), }", ""));
  expect_error([&] { read_npy(f.path); }, {f.path, "too large"});
}

TEST(RouteArrayNpy, WriteErrorsNameTheFile) {
  std::string p = tmp_path("no_such_dir") + "/x.npy";
  expect_error([&] { write_npy(p, RouteArray(1, 1, 1)); }, {p});
  RouteArray bad(2, 2, 2);
  bad.data.resize(3);
  TmpFile f("bad.npy");
  expect_error([&] { write_npy(f.path, bad); }, {f.path});
}

// Gate weights (return_routed_expert_weights): float32 beside the ids in every encoding, sliced
// and joined with their rows.
RouteArray weighted(int rows, int layers, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  RouteArray r(rows, layers, k);
  r.start = 3;
  for (int l = 0; l < layers; ++l) r.moe_layers.push_back(2 * l + 1);
  for (auto& v : r.data) v = int16_t(rng() % 64);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  for (size_t n = 0; n < r.data.size(); ++n) r.weights.push_back(unit(rng));
  return r;
}

TEST(RouteWeights, JsonNpyAndSglangCarryTheExactFloats) {
  const RouteArray r = weighted(7, 3, 4, 1);
  const json j = route_weights_to_json(r);
  EXPECT_EQ(j["dtype"], "float32");
  EXPECT_EQ(j["shape"], json::array({7, 3, 4}));
  EXPECT_EQ(j["start"], 3);
  EXPECT_EQ(route_weights_from_json(j), r.weights);
  expect_error(
      [&] {
        route_weights_from_json(
            json{{"shape", {7, 3, 4}}, {"dtype", "int16"}, {"data", j["data"]}});
      },
      {"dtype", "float32"});
  expect_error(
      [&] {
        route_weights_from_json(
            json{{"shape", {7, 3, 5}}, {"dtype", "float32"}, {"data", j["data"]}});
      },
      {"data", "bytes"});
  const std::string npy = npy_weight_bytes(r);
  EXPECT_NE(npy.find("'descr': '<f4'"), std::string::npos);
  EXPECT_NE(npy.find("'shape': (7, 3, 4)"), std::string::npos);
  const size_t header = 10 + (size_t(uint8_t(npy[8])) | size_t(uint8_t(npy[9])) << 8);
  EXPECT_EQ(header % 64, 0u);
  EXPECT_EQ(floats_of_bytes(std::vector<uint8_t>(npy.begin() + ptrdiff_t(header), npy.end())),
            r.weights);
  // SGLang's layout: every decoder layer (7 here), a dense layer's weights 0.
  const std::vector<uint8_t> b = base64_decode(encode_sglang_route_weights(r, 7));
  const std::vector<float> all = floats_of_bytes(b);
  ASSERT_EQ(all.size(), size_t(7 * 7 * 4));
  for (int row = 0; row < 7; ++row)
    for (int layer = 0; layer < 7; ++layer)
      for (int j2 = 0; j2 < 4; ++j2) {
        const float got = all[(size_t(row) * 7 + size_t(layer)) * 4 + size_t(j2)];
        if (layer % 2 == 0)
          EXPECT_EQ(got, 0.f);
        else
          EXPECT_EQ(got, r.weights[(size_t(row) * 3 + size_t(layer / 2)) * 4 + size_t(j2)]);
      }
  RouteArray unweighted = r;
  unweighted.weights.clear();
  expect_error([&] { encode_sglang_route_weights(unweighted, 7); }, {"no weights"});
  expect_error([&] { npy_weight_bytes(unweighted); }, {"weights"});
}

TEST(RouteWeights, RowsSliceAndJoinWithTheirWeights) {
  const RouteArray r = weighted(9, 2, 3, 2);
  const RouteArray mid = route_rows(r, 5, 9);
  ASSERT_EQ(mid.rows, 4);
  ASSERT_EQ(mid.weights.size(), mid.data.size());
  EXPECT_TRUE(std::equal(mid.weights.begin(), mid.weights.end(), r.weights.begin() + 2 * 6));
  RouteArray joined = route_rows(r, 3, 5);
  joined.append(mid);
  EXPECT_EQ(joined.rows, 6);
  EXPECT_EQ(joined.weights, std::vector<float>(r.weights.begin(), r.weights.begin() + 6 * 6));
  EXPECT_EQ(joined.data, std::vector<int16_t>(r.data.begin(), r.data.begin() + 6 * 6));
  RouteArray without = route_rows(r, 3, 4);
  without.weights.clear();
  without.append(mid);  // rows without weights never pair with some that have them
  EXPECT_FALSE(without.has_weights());
  EXPECT_EQ(without.rows, 5);
}

}  // namespace
}  // namespace r3
