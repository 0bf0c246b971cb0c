// The request vocabulary (engine/request_fields.h): every row a front end reads is read into its
// option under each of its names there, and a value of the wrong type or range is refused naming
// both the option and the name it came under.
#include <gtest/gtest.h>

#include <random>

#include "engine/request_fields.h"

namespace r3 {
namespace {

using json = nlohmann::json;

// body with `value` at a possibly dotted name.
json with(const std::string& name, const json& value) {
  json body = json::object();
  json* at = &body;
  size_t from = 0;
  for (size_t dot; (dot = name.find('.', from)) != std::string::npos; from = dot + 1)
    at = &(*at)[name.substr(from, dot - from)];
  (*at)[name.substr(from)] = value;
  return body;
}

// A value each kind accepts, seeded, and one it refuses.
json good(const RequestField& row, std::mt19937& rng) {
  switch (row.kind) {
    case FieldKind::Int:
      return std::uniform_int_distribution<int64_t>(row.lo, std::min<int64_t>(row.hi, 1000))(rng);
    case FieldKind::Number:
      return std::uniform_real_distribution<double>(0.1, 2.0)(rng);
    case FieldKind::Bool:
      return bool(rng() % 2);
    case FieldKind::Seed:
      return uint64_t(rng()) << 20;
    case FieldKind::TokenIds:
      return json::array({int(rng() % 1000), int(rng() % 1000)});
    case FieldKind::Strings:
      return rng() % 2 ? json("stop here") : json::array({"a", "bc"});
  }
  return nullptr;
}
json bad(const RequestField& row) {
  switch (row.kind) {
    case FieldKind::Int:
      return row.hi + 1;
    case FieldKind::Number:
      return "1.0";
    case FieldKind::Bool:
      return 1;
    case FieldKind::Seed:
      return -1;
    case FieldKind::TokenIds:
      return json::array({1, 1e12});
    case FieldKind::Strings:
      return json::array({"a", ""});
  }
  return nullptr;
}

std::vector<std::string> names_of(const RequestField& row, FrontEnd fe) {
  std::vector<std::string> out;
  std::string all = row.names[size_t(fe)];
  for (size_t at = 0; !all.empty();) {
    const size_t bar = all.find('|', at);
    out.push_back(all.substr(at, bar - at));
    if (bar == std::string::npos) break;
    at = bar + 1;
  }
  return out;
}

TEST(RequestFields, EveryNameOfEveryFrontEndIsReadAndCheckedByItsRow) {
  std::mt19937 rng(4242);
  int read = 0;
  for (int f = 0; f < kFrontEnds; ++f) {
    const FrontEnd fe = FrontEnd(f);
    for (const RequestField& row : request_fields()) {
      if (!row.set) continue;
      for (const std::string& name : names_of(row, fe)) {
        SCOPED_TRACE("front end " + std::to_string(f) + " " + row.option + " as " + name);
        for (int trial = 0; trial < 4; ++trial) {
          const json v = good(row, rng);
          SamplingParams want, got;
          row.set(want, v);
          const auto given = read_request_fields(with(name, v), fe, got);
          ASSERT_EQ(given.size(), 1u);
          EXPECT_EQ(given.at(row.option), name);
          // The row's setter alone changed got: it equals want member by member.
          EXPECT_EQ(json(got.max_tokens), json(want.max_tokens));
          EXPECT_EQ(got.temperature, want.temperature);
          EXPECT_EQ(got.top_p, want.top_p);
          EXPECT_EQ(got.top_k, want.top_k);
          EXPECT_EQ(got.seed, want.seed);
          EXPECT_EQ(got.stop_token_ids, want.stop_token_ids);
          EXPECT_EQ(got.stop, want.stop);
          EXPECT_EQ(got.include_stop_str_in_output, want.include_stop_str_in_output);
          EXPECT_EQ(got.skip_special_tokens, want.skip_special_tokens);
          EXPECT_EQ(got.ignore_eos, want.ignore_eos);
          EXPECT_EQ(got.logprobs, want.logprobs);
          EXPECT_EQ(got.return_routed_experts, want.return_routed_experts);
          EXPECT_EQ(got.routed_experts_start, want.routed_experts_start);
          EXPECT_EQ(got.return_routed_expert_weights, want.return_routed_expert_weights);
          ++read;
        }
        SamplingParams p;
        try {
          read_request_fields(with(name, bad(row)), fe, p);
          ADD_FAILURE() << "a bad value was read";
        } catch (const RequestFieldError& e) {
          EXPECT_EQ(e.field(), row.option);
          EXPECT_EQ(e.name(), name);
          EXPECT_NE(std::string(e.what()).find("\"" + name + "\""), std::string::npos) << e.what();
        }
        // null is "not given": the front end's default stays.
        SamplingParams untouched;
        EXPECT_TRUE(read_request_fields(with(name, nullptr), fe, untouched).empty());
      }
    }
  }
  EXPECT_GT(read, 200);
}

// Two names of one option: the first given is read, or, for a one_of row, both is an error
// naming the second; every name a front end reads is among the names it accepts at the top.
TEST(RequestFields, SeveralNamesOfOneOptionAndTheNamesEachFrontEndAccepts) {
  SamplingParams p;
  json chat = {{"max_completion_tokens", 7}, {"max_tokens", 9}};
  read_request_fields(chat, FrontEnd::Chat, p);
  EXPECT_EQ(p.max_tokens, 7);
  json sglang = {{"routed_experts_start_len", 2}, {"routed_experts_start", 3}};
  try {
    read_request_fields(sglang, FrontEnd::Generate, p);
    ADD_FAILURE() << "both names of a one_of option were read";
  } catch (const RequestFieldError& e) {
    EXPECT_EQ(e.field(), "routed_experts_start");
    EXPECT_EQ(e.name(), "routed_experts_start");
  }
  for (int f = 0; f < kFrontEnds; ++f)
    for (const RequestField& row : request_fields())
      for (const std::string& name : names_of(row, FrontEnd(f))) {
        const std::vector<std::string> top = names_in(FrontEnd(f));
        EXPECT_NE(std::find(top.begin(), top.end(), name.substr(0, name.find('.'))), top.end())
            << name;
        EXPECT_EQ(name_in(row.option, FrontEnd(f)), names_of(row, FrontEnd(f))[0]);
      }
  EXPECT_EQ(name_in("top_p", FrontEnd::Generate), "sampling_params.top_p");
  EXPECT_EQ(name_in("prompt", FrontEnd::Chat), "messages");
  const std::vector<std::string> under = names_in(FrontEnd::Generate, "sampling_params");
  EXPECT_NE(std::find(under.begin(), under.end(), "max_new_tokens"), under.end());
}

// An integer row takes exactly [lo, hi], whether JSON holds the value signed or unsigned (it reads
// every non-negative integer as unsigned): the server's own fields (n in [1, 256]) use the same
// check.
TEST(RequestFields, AnIntegerTakesExactlyItsRange) {
  const RequestField n{"n", FieldKind::Int, 1, 256, {}};
  for (const char* text : {"1", "256", "7"})
    EXPECT_NO_THROW(check_field(n, "n", json::parse(text)));
  for (const char* text : {"0", "-1", "257", "9223372036854775808", "1.5"})
    EXPECT_THROW(check_field(n, "n", json::parse(text)), RequestFieldError) << text;
}

}  // namespace
}  // namespace r3
