// The HTTP server in-process on an ephemeral loopback port, driven with httplib::Client (and a
// raw socket for the disconnect test). Every reply's tokens, logprobs and routes are compared
// bit for bit with the same request run alone through an Engine (the solo run).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fstream>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/config.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "routes/route_array.h"
#include "routes/route_envelope.h"
#include "routes/route_formats.h"
#include "server/server.h"
#include "staging/staging.h"
#include "test_models.h"

namespace r3 {
namespace {

using json = nlohmann::json;
using testing::expect_matches_solo;
using testing::test_model;

EngineConfig server_engine_config(const std::string& model) {
  EngineConfig c;
  c.model = model;
  c.num_kv_blocks =
      128;  // 2048 tokens, under the model's 4096: "does not fit the KV pool" is testable
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 64;  // chunked prefill and batching happen
  c.threads = 1;
  c.enable_return_routed_experts = true;
  return c;
}

struct Running {
  std::unique_ptr<server::Server> srv;
  int port = 0;
  explicit Running(EngineConfig c, server::ServerOptions o = {}) {
    o.port = 0;
    o.http_threads = 32;
    srv = std::make_unique<server::Server>(std::move(c), std::move(o));
    port = srv->start();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    return c;
  }
};

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::string(test_model("olmoe"));
    server_ = new Running(server_engine_config(*model_));
    solo_ = new Engine(testing::solo_config(*model_));
  }
  static void TearDownTestSuite() {
    delete server_;
    delete solo_;
    delete model_;
  }

  static RequestOutput solo(const std::vector<int>& prompt, SamplingParams p) {
    p.return_routed_experts = true;
    p.routed_experts_start = 0;
    return solo_->generate({prompt}, {p})[0];
  }

  static json post(const std::string& path, const json& body, int expect_status = 200) {
    auto cli = server_->client();
    auto res = cli.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(res) << path << ": " << httplib::to_string(res.error());
    if (!res) return json();
    EXPECT_EQ(res->status, expect_status) << path << " " << body.dump() << " -> " << res->body;
    return json::parse(res->body, nullptr, false);
  }

  // Waits until a /generate under `rid` is in flight: a second call under a rid in flight is
  // refused before anything else is checked, so probe with a call the engine would refuse (a bad
  // id), which never takes the rid itself.
  static bool wait_in_flight(const std::string& rid) {
    auto cli = server_->client();
    const std::string probe = json{{"input_ids", {1, 99999}}, {"rid", rid}}.dump();
    for (int i = 0; i < 5000; ++i) {
      auto res = cli.Post("/generate", probe, "application/json");
      if (res && res->status == 400 && json::parse(res->body)["error"]["param"] == "rid")
        return true;
    }
    return false;
  }

  static std::string* model_;
  static Running* server_;
  static Engine* solo_;
};
std::string* ServerTest::model_ = nullptr;
Running* ServerTest::server_ = nullptr;
Engine* ServerTest::solo_ = nullptr;

std::vector<int> ids_of(const json& j) { return j.get<std::vector<int>>(); }

// The routes a reply object carries, whatever its routed_experts_format, back in r3's form: the
// way each peer's clients decode them (slime: base64 -> int32 -> [rows, num_layers, K]; vLLM:
// np.load of the base64 .npy parts; NeMo-RL: the envelope). The test model's config gives the
// layer layout.
std::optional<RouteArray> decode_routes(const json& obj, size_t prompt_len,
                                        const std::string& model) {
  if (!obj.contains("routed_experts") || obj["routed_experts"].is_null()) return std::nullopt;
  const ModelConfig c = load_config(model + "/config.json");
  const std::string fmt = obj.value("routed_experts_format", "r3");
  const int start = obj.value("routed_experts_start_len", 0);
  RouteArray r;
  if (fmt == "r3") {
    r = routes_from_json(obj["routed_experts"]);
  } else if (fmt == "sglang") {
    r = decode_sglang_routes(obj["routed_experts"].get<std::string>(), c.num_layers, c.top_k,
                             c.moe_layers(), start);
  } else if (fmt == "nrlre1") {
    r = decode_envelope(obj["routed_experts"].get<std::string>());
    r.start = start;
    r.moe_layers = c.moe_layers();
  } else if (fmt == "vllm") {
    auto npy = [](const json& s) {
      const std::vector<uint8_t> b = base64_decode(s.get<std::string>());
      return parse_npy(std::string(b.begin(), b.end()));
    };
    const RouteArray prompt = npy(obj["prompt_routed_experts"]), out = npy(obj["routed_experts"]);
    EXPECT_EQ(prompt.layers, out.layers);
    r = RouteArray(prompt.rows + out.rows, out.layers, out.k);
    std::copy(prompt.data.begin(), prompt.data.end(), r.data.begin());
    std::copy(out.data.begin(), out.data.end(), r.data.begin() + ptrdiff_t(prompt.data.size()));
    r.start = int(prompt_len) - prompt.rows;
    r.moe_layers = c.moe_layers();
  } else {
    ADD_FAILURE() << "unknown routed_experts_format " << fmt;
  }
  return r;
}

// A /v1/completions choice as a RequestOutput (for expect_matches_solo).
RequestOutput from_choice(const json& c, const std::vector<int>& prompt) {
  RequestOutput o;
  o.prompt_token_ids = prompt;
  o.token_ids = ids_of(c["token_ids"]);
  if (c["logprobs"].is_object())
    for (const auto& v : c["logprobs"]["token_logprobs"])
      o.logprobs.push_back(float(v.get<double>()));
  o.finish_reason = c["finish_reason"].get<std::string>();
  o.routed_experts =
      decode_routes(c, prompt.size(), test_model("olmoe"));  // every model here has its layout
  return o;
}

// A /generate reply as a RequestOutput.
RequestOutput from_generate(const json& r, const std::vector<int>& prompt) {
  RequestOutput o;
  o.prompt_token_ids = prompt;
  o.token_ids = ids_of(r["output_ids"]);
  for (const auto& v : r["meta_info"]["output_token_logprobs"])
    o.logprobs.push_back(float(v[0].get<double>()));
  o.finish_reason = r["meta_info"]["finish_reason"]["type"].get<std::string>();
  o.routed_experts = decode_routes(r["meta_info"], prompt.size(), test_model("olmoe"));
  return o;
}

std::vector<json> sse_events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    if (ev.rfind("data: ", 0) != 0) continue;  // comments (keep-alives)
    std::string data = ev.substr(6);
    if (data == "[DONE]") {
      *done = true;
      continue;
    }
    out.push_back(json::parse(data));
  }
  return out;
}

// The rows of a reply's or a streamed chunk's routes, in order, whatever the format (a streamed
// vllm chunk carries its prompt part only when it has prompt rows).
RouteArray chunk_routes(const json& obj) {
  if (obj.value("routed_experts_format", "r3") != "vllm")
    return *decode_routes(obj, 0, test_model("olmoe"));
  RouteArray r;
  for (const char* k : {"prompt_routed_experts", "routed_experts"}) {
    if (!obj.contains(k)) continue;
    const std::vector<uint8_t> b = base64_decode(obj[k].get<std::string>());
    const RouteArray part = parse_npy(std::string(b.begin(), b.end()));
    r.layers = part.layers;
    r.k = part.k;
    r.rows += part.rows;
    r.data.insert(r.data.end(), part.data.begin(), part.data.end());
  }
  return r;
}

// Rows appended to rows (the concatenation a streaming client makes).
void append_rows(RouteArray& rows, const RouteArray& more) {
  if (rows.rows == 0) {
    rows.layers = more.layers;
    rows.k = more.k;
  }
  rows.rows += more.rows;
  rows.data.insert(rows.data.end(), more.data.begin(), more.data.end());
}

std::vector<int> prompt_of(int len, int salt) {
  std::vector<int> p;
  for (int i = 0; i < len; ++i) p.push_back(3 + (i * 37 + salt * 101) % 500);
  return p;
}

TEST_F(ServerTest, HealthAndModels) {
  auto cli = server_->client();
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto m = cli.Get("/v1/models");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  json j = json::parse(m->body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["data"][0]["id"], *model_);
  EXPECT_EQ(j["data"][0]["max_model_len"], 4096);
}

TEST_F(ServerTest, GenerateEqualsSoloRun) {
  const std::vector<int> prompt = prompt_of(70, 1);  // longer than one 64-token step: chunked
  json body = {{"input_ids", prompt},
               {"sampling_params",
                {{"max_new_tokens", 12}, {"temperature", 1.0}, {"top_p", 0.9}, {"seed", 42}}},
               {"return_routed_experts", true}};
  json r = post("/generate", body);
  SamplingParams p;
  p.max_tokens = 12;
  p.top_p = 0.9f;
  p.seed = 42;
  p.return_routed_experts = true;
  const RequestOutput s = solo(prompt, p);
  expect_matches_solo(from_generate(r, prompt), s, false, p, "/generate");
  EXPECT_EQ(r["meta_info"]["prompt_tokens"], 70);
  EXPECT_EQ(r["meta_info"]["completion_tokens"], r["output_ids"].size());
  EXPECT_EQ(r["meta_info"]["weight_version"], "0");
  EXPECT_EQ(r["text"], "");
  // SGLang's format by default: base64 of int32 [S-1, num_hidden_layers, K].
  EXPECT_EQ(r["meta_info"]["routed_experts_format"], "sglang");
  const std::vector<uint8_t> raw =
      base64_decode(r["meta_info"]["routed_experts"].get<std::string>());
  EXPECT_EQ(raw.size(),
            (prompt.size() + r["output_ids"].size() - 1) * 2 * 2 * 4);  // 2 layers, K = 2

  // Delta start: only rows [N, S-1).
  body["routed_experts_start"] = 50;
  p.routed_experts_start = 50;
  r = post("/generate", body);
  expect_matches_solo(from_generate(r, prompt), s, false, p, "/generate delta");
  EXPECT_EQ(decode_routes(r["meta_info"], prompt.size(), *model_)->rows,
            int(prompt.size() + r["output_ids"].size()) - 1 - 50);
  EXPECT_EQ(r["meta_info"]["routed_experts_start_len"], 50);
  // SGLang's name for the same delta, and null for options a client leaves unset.
  body.erase("routed_experts_start");
  body["routed_experts_start_len"] = 50;
  body["lora_path"] = nullptr;
  body["image_data"] = nullptr;
  json r2 = post("/generate", body);
  EXPECT_EQ(r2["meta_info"]["routed_experts"], r["meta_info"]["routed_experts"]);
  EXPECT_EQ(r2["meta_info"]["routed_experts_start_len"], 50);

  // A batch of input_ids answers with a list.
  json batch = {{"input_ids", {prompt_of(5, 2), prompt_of(9, 3)}},
                {"sampling_params", {{"max_new_tokens", 4}, {"temperature", 0}}}};
  json rs = post("/generate", batch);
  ASSERT_TRUE(rs.is_array());
  ASSERT_EQ(rs.size(), 2u);
  SamplingParams g;
  g.max_tokens = 4;
  g.temperature = 0;
  for (int i = 0; i < 2; ++i) {
    const auto pr = prompt_of(i == 0 ? 5 : 9, i + 2);
    RequestOutput got = from_generate(rs[size_t(i)], pr);
    EXPECT_FALSE(got.routed_experts.has_value());
    expect_matches_solo(got, solo(pr, g), false, g, "batch " + std::to_string(i));
  }
}

TEST_F(ServerTest, CompletionsEqualSoloRuns) {
  const std::vector<std::vector<int>> prompts = {prompt_of(20, 4), prompt_of(33, 5)};
  json body = {
      {"model", *model_},   {"prompt", prompts}, {"n", 2},        {"max_tokens", 10},
      {"temperature", 1.0}, {"seed", 7},         {"logprobs", 1}, {"return_routed_experts", true}};
  json r = post("/v1/completions", body);
  ASSERT_EQ(r["choices"].size(), 4u);
  EXPECT_EQ(r["object"], "text_completion");
  size_t completion = 0;
  for (size_t i = 0; i < 4; ++i) {
    const json& c = r["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["text"], "");
    SamplingParams p;
    p.max_tokens = 10;
    p.seed = 7 + i % 2;  // sample j of a prompt uses seed + j
    p.return_routed_experts = true;
    expect_matches_solo(from_choice(c, prompts[i / 2]), solo(prompts[i / 2], p), false, p,
                        "choice " + std::to_string(i));
    completion += c["token_ids"].size();
  }
  EXPECT_EQ(r["usage"]["prompt_tokens"], 53);
  EXPECT_EQ(r["usage"]["completion_tokens"], completion);
  // The two samples of a prompt differ (different seeds).
  EXPECT_NE(r["choices"][0]["token_ids"], r["choices"][1]["token_ids"]);

  // Without logprobs and routes, neither is returned.
  json plain =
      post("/v1/completions", {{"prompt", prompts[0]}, {"max_tokens", 3}, {"ignore_eos", true}});
  EXPECT_TRUE(plain["choices"][0]["logprobs"].is_null());
  EXPECT_FALSE(plain["choices"][0].contains("routed_experts"));
  EXPECT_EQ(plain["choices"][0]["token_ids"].size(), 3u);
}

TEST_F(ServerTest, StreamedCompletionsEqualSoloRuns) {
  const std::vector<std::vector<int>> prompts = {prompt_of(12, 6), prompt_of(40, 7)};
  json body = {{"prompt", prompts},        {"max_tokens", 40},
               {"temperature", 0.8},       {"seed", 11},
               {"stream", true},           {"logprobs", true},
               {"ignore_eos", true},       {"return_routed_experts", true},
               {"routed_experts_start", 5}};
  auto cli = server_->client();
  auto res = cli.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  EXPECT_NE(res->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  bool done = false;
  std::vector<json> events = sse_events(res->body, &done);
  EXPECT_TRUE(done) << "no data: [DONE]";
  ASSERT_GE(events.size(), 3u);
  std::vector<json> merged(
      2, json{{"token_ids", json::array()}, {"logprobs", {{"token_logprobs", json::array()}}}});
  std::vector<RouteArray> rows(2);  // each chunk's route rows, concatenated
  int finishes = 0;
  for (size_t e = 0; e + 1 < events.size(); ++e) {
    ASSERT_EQ(events[e]["choices"].size(), 1u);
    const json& c = events[e]["choices"][0];
    json& m = merged[c["index"].get<size_t>()];
    for (const auto& t : c["token_ids"]) m["token_ids"].push_back(t);
    for (const auto& l : c["logprobs"]["token_logprobs"])
      m["logprobs"]["token_logprobs"].push_back(l);
    if (c.contains("routed_experts")) append_rows(rows[c["index"].get<size_t>()], chunk_routes(c));
    if (!c["finish_reason"].is_null()) {
      ++finishes;
      m["finish_reason"] = c["finish_reason"];
    }
  }
  EXPECT_EQ(finishes, 2);
  // (How many chunks carry the tokens depends on timing: a stream sends what is new since its
  // last write, so a fast engine may finish before the first write.)
  const json& last = events.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"]["completion_tokens"], 80);
  EXPECT_EQ(last["usage"]["prompt_tokens"], 52);
  for (size_t i = 0; i < 2; ++i) {
    SamplingParams p;
    p.max_tokens = 40;
    p.temperature = 0.8f;
    p.seed = 11;
    p.ignore_eos = true;
    p.return_routed_experts = true;
    p.routed_experts_start = 5;
    RequestOutput got = from_choice(merged[i], prompts[i]);
    rows[i].start = 5;
    rows[i].moe_layers = load_config(*model_ + "/config.json").moe_layers();
    got.routed_experts = rows[i];
    expect_matches_solo(got, solo(prompts[i], p), false, p, "streamed choice " + std::to_string(i));
  }
}

// The gate weights of a reply's or a streamed chunk's rows (routed_expert_weights, and the vllm
// format's prompt_routed_expert_weights), MoE columns, rows in order; empty when it has none.
std::vector<float> chunk_weights(const json& obj) {
  const std::string fmt = obj.value("routed_experts_format", "r3");
  std::vector<float> out;
  auto floats = [](const std::string& b64, size_t skip) {
    const std::vector<uint8_t> b = base64_decode(b64);
    return floats_of_bytes(std::vector<uint8_t>(b.begin() + ptrdiff_t(skip), b.end()));
  };
  if (fmt == "vllm") {
    for (const char* k : {"prompt_routed_expert_weights", "routed_expert_weights"}) {
      if (!obj.contains(k)) continue;
      const std::vector<uint8_t> b = base64_decode(obj[k].get<std::string>());
      const std::string head(b.begin(), b.begin() + 128);
      EXPECT_NE(head.find("'descr': '<f4'"), std::string::npos) << head;
      const size_t header = 10 + (size_t(b[8]) | size_t(b[9]) << 8);  // npy 1.0
      const std::vector<float> part = floats(obj[k].get<std::string>(), header);
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
  if (!obj.contains("routed_expert_weights")) return out;
  if (fmt == "sglang") {  // every decoder layer: keep the MoE ones
    const ModelConfig c = load_config(test_model("olmoe") + "/config.json");
    const std::vector<float> all = floats(obj["routed_expert_weights"].get<std::string>(), 0);
    const size_t row = size_t(c.num_layers) * size_t(c.top_k);
    for (size_t r = 0; r < all.size() / row; ++r)
      for (int l : c.moe_layers())
        for (int j = 0; j < c.top_k; ++j)
          out.push_back(all[r * row + size_t(l) * size_t(c.top_k) + size_t(j)]);
    return out;
  }
  return route_weights_from_json(obj["routed_expert_weights"]);  // r3, nrlre1
}

// An engine refusal names the field under the endpoint's own name (FieldError's field mapped by
// param_of_field), not guessed from its message: SGLang's sampling fields sit under
// sampling_params., its prompt-score cut is logprob_start_len.
TEST_F(ServerTest, EngineRefusalsNameTheFieldInTheEndpointsVocabulary) {
  const std::vector<std::tuple<std::string, json, std::string>> cases = {
      {"/v1/completions", {{"prompt", {3, 4, 5}}, {"top_p", 0}}, "top_p"},
      {"/generate",
       {{"input_ids", {3, 4, 5}}, {"sampling_params", {{"top_p", 0}}}},
       "sampling_params.top_p"},
      {"/generate",
       {{"input_ids", {3, 4, 5}}, {"sampling_params", {{"temperature", -1}}}},
       "sampling_params.temperature"},
      {"/generate", {{"input_ids", {3, 4, 5}}, {"logprob_start_len", 9}}, "logprob_start_len"},
      {"/v1/completions", {{"prompt", {3, 4, 5}}, {"max_tokens", 1 << 20}}, "prompt"},
      {"/generate",
       {{"input_ids", {3, 4, 5}}, {"sampling_params", {{"max_new_tokens", 1 << 20}}}},
       "input_ids"},
  };
  for (const auto& [path, body, param] : cases) {
    const json err = post(path, body, 400);
    EXPECT_EQ(err["error"]["param"], param) << path << " " << body.dump() << " -> " << err.dump();
  }
}

// return_routed_expert_weights: every route row comes with the gate weight of each chosen expert
// (float32, the ids' order), in every format, non-streamed and streamed, /generate and
// /v1/completions, bitwise the engine's own (its solo run), from the requested start; absent
// unless asked for, and asking without routes is a 400 naming the field.
TEST_F(ServerTest, GateWeightsComeWithTheirRoutesInEveryFormat) {
  std::mt19937 rng(3523);
  const char* formats[] = {"r3", "sglang", "vllm", "nrlre1"};
  for (int trial = 0; trial < 8; ++trial) {
    const std::string fmt = formats[trial % 4];
    const int P = std::uniform_int_distribution<int>(2, 40)(rng);
    const int start = std::uniform_int_distribution<int>(0, P)(rng);
    const int max_tokens = std::uniform_int_distribution<int>(1, 24)(rng);
    const std::vector<int> prompt = prompt_of(P, 300 + trial);
    SCOPED_TRACE("trial " + std::to_string(trial) + " " + fmt + " P " + std::to_string(P) +
                 " start " + std::to_string(start) + " max_tokens " + std::to_string(max_tokens));
    SamplingParams sp = testing::greedy(max_tokens);
    sp.return_routed_expert_weights = true;
    const RouteArray want = *solo(prompt, sp).routed_experts;
    ASSERT_EQ(want.weights.size(), want.data.size());
    const size_t row = size_t(want.layers) * size_t(want.k);
    const std::vector<float> expected(want.weights.begin() + ptrdiff_t(size_t(start) * row),
                                      want.weights.end());
    auto expect_bits = [&](const std::vector<float>& got, const std::string& where) {
      ASSERT_EQ(got.size(), expected.size()) << where;
      EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), got.size() * sizeof(float))) << where;
    };
    const json g = {{"input_ids", prompt},
                    {"sampling_params",
                     {{"max_new_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}}},
                    {"return_routed_experts", true},
                    {"return_routed_expert_weights", true},
                    {"routed_experts_start_len", start},
                    {"routed_experts_format", fmt}};
    expect_bits(chunk_weights(post("/generate", g)["meta_info"]), "/generate");
    json c = {{"prompt", prompt},
              {"max_tokens", max_tokens},
              {"temperature", 0},
              {"ignore_eos", true},
              {"return_routed_experts", true},
              {"return_routed_expert_weights", true},
              {"routed_experts_start", start},
              {"routed_experts_format", fmt}};
    const json whole = post("/v1/completions", c)["choices"][0];
    expect_bits(chunk_weights(whole), "/v1/completions");
    EXPECT_EQ(
        chunk_routes(whole).data,
        std::vector<int16_t>(want.data.begin() + ptrdiff_t(size_t(start) * row), want.data.end()));
    // Streamed: each chunk's weights with its rows, concatenating to the whole.
    c["stream"] = true;
    auto res = server_->client().Post("/v1/completions", c.dump(), "application/json");
    ASSERT_TRUE(res && res->status == 200);
    bool done = false;
    std::vector<float> streamed;
    for (const json& ev : sse_events(res->body, &done))
      for (const json& ch : ev["choices"]) {
        if (!ch.contains("routed_experts")) continue;
        const std::vector<float> w = chunk_weights(ch);
        EXPECT_EQ(w.size(), chunk_routes(ch).data.size());  // a weight for each id it carries
        streamed.insert(streamed.end(), w.begin(), w.end());
      }
    EXPECT_TRUE(done);
    expect_bits(streamed, "streamed /v1/completions");
  }
  // Not asked for: none; asked for without routes: refused by name.
  const json plain = post("/generate", {{"input_ids", {3, 4, 5}},
                                        {"sampling_params", {{"max_new_tokens", 2}}},
                                        {"return_routed_experts", true}});
  EXPECT_FALSE(plain["meta_info"].contains("routed_expert_weights"));
  for (const char* path : {"/generate", "/v1/completions"}) {
    const json body = std::string(path) == "/generate"
                          ? json{{"input_ids", {3, 4, 5}}, {"return_routed_expert_weights", true}}
                          : json{{"prompt", {3, 4, 5}}, {"return_routed_expert_weights", true}};
    const json err = post(path, body, 400);
    EXPECT_EQ(err["error"]["param"], "return_routed_expert_weights") << path << " " << err.dump();
  }
}

// Streamed routes come with their tokens: on /v1/completions every chunk carries the rows of its
// tokens (the first also the prompt's from routed_experts_start), and their concatenation is the
// non-streamed reply's routes, in every format, over seeded random prompts, lengths and starts
// (the chunking is the stream's own timing). A streamed /generate is SGLang's: each chunk the
// reply so far, the last one the non-streamed reply, routes included.
TEST_F(ServerTest, StreamedRouteRowsConcatenateToTheNonStreamedRoutes) {
  std::mt19937 rng(45);
  const char* formats[] = {"r3", "sglang", "vllm", "nrlre1"};
  auto stream = [&](const std::string& path, const json& body) {
    auto res = server_->client().Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(res && res->status == 200) << (res ? res->body : "no reply");
    bool done = false;
    std::vector<json> events = res ? sse_events(res->body, &done) : std::vector<json>{};
    EXPECT_TRUE(done) << path << ": no data: [DONE]";
    return events;
  };
  for (int trial = 0; trial < 12; ++trial) {
    const std::string fmt = formats[trial % 4];
    const int P = std::uniform_int_distribution<int>(2, 60)(rng);
    const int start = std::uniform_int_distribution<int>(0, P)(rng);
    const std::vector<int> prompt = prompt_of(P, 100 + trial);
    const int max_tokens = std::uniform_int_distribution<int>(1, 48)(rng);
    SCOPED_TRACE("trial " + std::to_string(trial) + " " + fmt + " P " + std::to_string(P) +
                 " start " + std::to_string(start) + " max_tokens " + std::to_string(max_tokens));
    json body = {{"prompt", prompt},
                 {"max_tokens", max_tokens},
                 {"temperature", 0.9},
                 {"seed", trial},
                 {"ignore_eos", true},
                 {"return_routed_experts", true},
                 {"routed_experts_start", start},
                 {"routed_experts_format", fmt}};
    const json whole = post("/v1/completions", body)["choices"][0];
    body["stream"] = true;
    RouteArray rows;
    int with_rows = 0;
    json tokens = json::array();
    for (const json& ev : stream("/v1/completions", body))
      for (const json& c : ev["choices"]) {
        for (const auto& t : c["token_ids"]) tokens.push_back(t);
        if (c.contains("routed_experts")) {
          ++with_rows;
          append_rows(rows, chunk_routes(c));
        }
        // Rows come with their tokens: after a chunk, those of every position but the newest.
        if (c["finish_reason"].is_null()) {
          EXPECT_EQ(start + rows.rows, std::max(start, P + int(tokens.size()) - 1))
              << "after " << tokens.size() << " tokens";
        }
      }
    EXPECT_EQ(tokens, whole["token_ids"]);
    const RouteArray expected = chunk_routes(whole);
    EXPECT_EQ(rows.rows, expected.rows);
    EXPECT_EQ(rows.data, expected.data);
    EXPECT_GE(with_rows, 1);

    json g = {{"input_ids", prompt},
              {"sampling_params",
               {{"max_new_tokens", max_tokens},
                {"temperature", 0.9},
                {"seed", trial},
                {"ignore_eos", true}}},
              {"return_routed_experts", true},
              {"routed_experts_start_len", start},
              {"routed_experts_format", fmt}};
    const json reply = post("/generate", g);
    g["stream"] = true;
    const std::vector<json> events = stream("/generate", g);
    ASSERT_FALSE(events.empty());
    json previous_ids = json::array();
    for (size_t e = 0; e < events.size(); ++e) {
      const json& ids = events[e]["output_ids"];  // cumulative: each chunk's ids extend the last's
      ASSERT_GE(ids.size(), previous_ids.size());
      EXPECT_TRUE(std::equal(previous_ids.begin(), previous_ids.end(), ids.begin()));
      previous_ids = ids;
      if (e + 1 < events.size()) {
        EXPECT_TRUE(events[e]["meta_info"]["finish_reason"].is_null());
      }
    }
    const json& last = events.back();
    EXPECT_EQ(last["output_ids"], reply["output_ids"]);
    EXPECT_EQ(last["meta_info"]["output_token_logprobs"],
              reply["meta_info"]["output_token_logprobs"]);
    EXPECT_EQ(last["meta_info"]["finish_reason"], reply["meta_info"]["finish_reason"]);
    EXPECT_EQ(chunk_routes(last["meta_info"]).data, chunk_routes(reply["meta_info"]).data);
  }
}

// vLLM's name for the prompt cut (routed_experts_prompt_start, vllm #51906) gives the rows
// routed_experts_start gives; the prompt's length is allowed (no prompt rows), past it or beside
// routed_experts_start is a 400 naming it.
TEST_F(ServerTest, VllmsPromptStartIsTheRouteCut) {
  const std::vector<int> p = prompt_of(30, 9);
  auto body = [&](const char* key, int start) {
    return json{{"prompt", p},
                {"max_tokens", 5},
                {"seed", 3},
                {"return_routed_experts", true},
                {key, start}};
  };
  for (int start : {0, 17, 30}) {
    const json a = post("/v1/completions", body("routed_experts_start", start))["choices"][0];
    const json b =
        post("/v1/completions", body("routed_experts_prompt_start", start))["choices"][0];
    EXPECT_EQ(a["prompt_routed_experts"], b["prompt_routed_experts"]) << start;
    EXPECT_EQ(a["routed_experts"], b["routed_experts"]) << start;
    EXPECT_EQ(chunk_routes(b).rows, 30 + 4 - start) << start;
  }
  json past = post("/v1/completions", body("routed_experts_prompt_start", 31), 400);
  EXPECT_EQ(past["error"]["param"], "routed_experts_prompt_start");
  json both = body("routed_experts_prompt_start", 2);
  both["routed_experts_start"] = 2;
  EXPECT_EQ(post("/v1/completions", both, 400)["error"]["param"], "routed_experts_prompt_start");
}

TEST_F(ServerTest, ConcurrentClientsEqualSoloRuns) {
  constexpr int kClients = 8, kEach = 3;
  std::vector<std::vector<json>> replies(kClients);
  std::vector<std::thread> ts;
  for (int c = 0; c < kClients; ++c)
    ts.emplace_back([&, c] {
      auto cli = server_->client();
      for (int k = 0; k < kEach; ++k) {
        json body = {{"prompt", prompt_of(5 + 7 * c + k, 100 + c)},
                     {"max_tokens", 6 + k},
                     {"seed", c * 10 + k},
                     {"return_routed_experts", true},
                     {"logprobs", true},
                     {"stream", k == 1}};
        auto res = cli.Post("/v1/completions", body.dump(), "application/json");
        replies[size_t(c)].push_back(res && res->status == 200 ? json(res->body) : json());
      }
    });
  for (auto& t : ts) t.join();
  for (int c = 0; c < kClients; ++c)
    for (int k = 0; k < kEach; ++k) {
      const json& raw = replies[size_t(c)][size_t(k)];
      ASSERT_TRUE(raw.is_string()) << "client " << c << " request " << k << " failed";
      json choice;
      RouteArray rows;  // a streamed call's: each chunk's rows, concatenated
      if (k == 1) {
        bool done = false;
        choice = {{"token_ids", json::array()}, {"logprobs", {{"token_logprobs", json::array()}}}};
        for (const json& ev : sse_events(raw.get<std::string>(), &done))
          for (const json& ch : ev["choices"]) {
            for (const auto& t : ch["token_ids"]) choice["token_ids"].push_back(t);
            for (const auto& l : ch["logprobs"]["token_logprobs"])
              choice["logprobs"]["token_logprobs"].push_back(l);
            if (ch.contains("routed_experts")) append_rows(rows, chunk_routes(ch));
            if (!ch["finish_reason"].is_null()) choice["finish_reason"] = ch["finish_reason"];
          }
        EXPECT_TRUE(done);
      } else {
        choice = json::parse(raw.get<std::string>())["choices"][0];
      }
      SamplingParams p;
      p.max_tokens = 6 + k;
      p.seed = uint64_t(c * 10 + k);
      p.return_routed_experts = true;
      const auto prompt = prompt_of(5 + 7 * c + k, 100 + c);
      RequestOutput got = from_choice(choice, prompt);
      if (k == 1) {
        rows.moe_layers = load_config(*model_ + "/config.json").moe_layers();
        got.routed_experts = rows;
      }
      expect_matches_solo(got, solo(prompt, p), false, p,
                          "client " + std::to_string(c) + " request " + std::to_string(k));
    }
}

TEST_F(ServerTest, AbortByRid) {
  json r;
  std::thread t([&] {
    r = post("/generate", {{"input_ids", prompt_of(8, 9)},
                           {"rid", "long-one"},
                           {"sampling_params", {{"max_new_tokens", 2000}, {"ignore_eos", true}}},
                           {"return_routed_experts", true}});
  });
  const bool in_flight = wait_in_flight("long-one");
  const int aborted = post("/abort", {{"rid", "long-one"}})["aborted"].get<int>();
  t.join();
  ASSERT_TRUE(in_flight);
  ASSERT_EQ(aborted, 1) << "the request finished before it could be aborted";
  EXPECT_EQ(r["meta_info"]["finish_reason"]["type"], "abort");
  EXPECT_LT(r["output_ids"].size(), 2000u);
  // Unknown ids abort nothing and are not an error.
  EXPECT_EQ(post("/abort", {{"request_id", "no-such"}})["aborted"], 0);

  // /v1/completions under the client's request_id; a non-streamed call answers with what it had.
  json c;
  std::thread t2([&] {
    c = post("/v1/completions", {{"prompt", prompt_of(8, 10)},
                                 {"request_id", "cmpl-mine"},
                                 {"n", 2},
                                 {"max_tokens", 2000},
                                 {"ignore_eos", true}});
  });
  int n = 0;
  for (int i = 0; i < 20000 && !n; ++i)
    n = post("/abort", {{"request_id", "cmpl-mine"}})["aborted"].get<int>();
  t2.join();
  EXPECT_EQ(n, 2);
  EXPECT_EQ(c["id"], "cmpl-mine");
  ASSERT_EQ(c["choices"].size(), 2u);
  EXPECT_EQ(c["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(c["choices"][1]["finish_reason"], "abort");
}

// The partial-rollout contract on every way an RL framework ends a /generate early: SGLang's
// /abort_request, /pause_generation in abort mode (then /continue_generation), and a refit with
// abort_all_requests (the same weights reloaded, so the bits can match). Each returns the
// partial tokens, logprobs and routes with finish_reason abort; resumed as prompt + partial with
// the same seed and routed_experts_start_len at the cut, the two calls equal the uninterrupted
// one. Each path on its own server (a refit moves the weight version).
TEST(ServerAbortResume, EveryAbortPathResumesExactlyAsTheUninterruptedCall) {
  const std::string model = test_model("olmoe");
  for (const std::string how : {"abort_request", "pause_abort", "refit_abort_all"}) {
    SCOPED_TRACE(how);
    Running server(server_engine_config(model));
    auto post = [&](const std::string& path, const json& body) {
      auto res = server.client().Post(path.c_str(), body.dump(), "application/json");
      EXPECT_TRUE(res && res->status == 200) << path << " -> " << (res ? res->body : "no reply");
      return res ? json::parse(res->body, nullptr, false) : json();
    };
    const std::vector<int> prompt = prompt_of(14, 21);
    const int budget = 2000;  // the abort lands long before the end
    auto call = [&](const std::vector<int>& ids, int max_new, int start, const char* rid) {
      json b = {
          {"input_ids", ids},
          {"sampling_params",
           {{"max_new_tokens", max_new}, {"temperature", 0.9}, {"seed", 5}, {"ignore_eos", true}}},
          {"return_routed_experts", true},
          {"routed_experts_start_len", start}};
      if (rid) b["rid"] = rid;
      return post("/generate", b);
    };
    json partial;
    std::thread t([&] { partial = call(prompt, budget, 0, "resume-me"); });
    // In flight once a second call under its rid is refused (probed with ids the engine refuses).
    bool in_flight = false;
    for (int i = 0; i < 5000 && !in_flight; ++i) {
      auto res = server.client().Post("/generate",
                                      json{{"input_ids", {1, 99999}}, {"rid", "resume-me"}}.dump(),
                                      "application/json");
      in_flight = res && res->status == 400 && json::parse(res->body)["error"]["param"] == "rid";
    }
    ASSERT_TRUE(in_flight);
    if (how == "abort_request") {
      EXPECT_EQ(post("/abort_request", {{"rid", "resume-me"}})["aborted"].get<int>(), 1);
    } else if (how == "pause_abort") {
      post("/pause_generation", {{"mode", "abort"}});
    } else {
      const json u =
          post("/update_weights_from_disk", {{"model_path", model}, {"abort_all_requests", true}});
      EXPECT_EQ(u["success"], true) << u.dump();
    }
    t.join();
    if (how == "pause_abort") post("/continue_generation", json::object());
    ASSERT_EQ(partial["meta_info"]["finish_reason"]["type"], "abort")
        << "finished before the abort";
    const std::vector<int> got = ids_of(partial["output_ids"]);
    ASSERT_LT(int(got.size()), budget);
    const RouteArray first = chunk_routes(partial["meta_info"]);
    ASSERT_EQ(first.rows, int(prompt.size() + got.size()) - 1) << "every computed row comes back";
    std::vector<int> resumed = prompt;
    resumed.insert(resumed.end(), got.begin(), got.end());
    const json rest = call(resumed, budget - int(got.size()), first.rows, nullptr);
    const json whole = call(prompt, budget, 0, nullptr);
    json tokens = partial["output_ids"], logprobs = partial["meta_info"]["output_token_logprobs"];
    for (const auto& x : rest["output_ids"]) tokens.push_back(x);
    for (const auto& x : rest["meta_info"]["output_token_logprobs"]) logprobs.push_back(x);
    EXPECT_EQ(tokens, whole["output_ids"]);
    EXPECT_EQ(logprobs, whole["meta_info"]["output_token_logprobs"]);
    RouteArray rows = first;
    append_rows(rows, chunk_routes(rest["meta_info"]));
    EXPECT_EQ(rows.data, chunk_routes(whole["meta_info"]).data)
        << "cut after " << got.size() << " tokens";
  }
}

// A client that disconnects mid-stream aborts its request (and frees its blocks).
TEST_F(ServerTest, StreamDisconnectAbortsRequest) {
  auto metric = [&](const std::string& name) {
    auto cli = server_->client();
    auto res = cli.Get("/metrics");
    EXPECT_TRUE(res);
    std::string key = "\n" + name + " ";
    size_t at = res->body.find(key);
    EXPECT_NE(at, std::string::npos) << name;
    return std::stod(res->body.substr(at + key.size()));
  };
  const double aborted0 = metric("r3_requests_aborted_total");

  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(server_->port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string body = json{
      {"prompt", prompt_of(10, 12)},
      {"max_tokens", 2000},
      {"ignore_eos", true},
      {"stream", true}}.dump();
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(write(fd, req.data(), req.size()), ssize_t(req.size()));
  std::string got;
  char buf[4096];
  while (got.find("data: {") == std::string::npos) {
    ssize_t n = read(fd, buf, sizeof buf);
    ASSERT_GT(n, 0);
    got.append(buf, size_t(n));
  }
  close(fd);

  bool seen = false;
  for (int i = 0; i < 500 && !seen; ++i) {
    seen = metric("r3_requests_aborted_total") > aborted0 && metric("r3_requests_in_flight") == 0;
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(seen) << "the disconnected stream's request was not aborted";
  EXPECT_EQ(metric("r3_requests_running"), 0);
  EXPECT_EQ(metric("r3_kv_blocks_free"), metric("r3_kv_blocks_total"));  // its blocks are back
}

TEST_F(ServerTest, Metrics) {
  post("/generate", {{"input_ids", prompt_of(6, 13)},
                     {"sampling_params", {{"max_new_tokens", 3}}},
                     {"return_routed_experts", true}});
  auto cli = server_->client();
  auto res = cli.Get("/metrics");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  EXPECT_NE(res->get_header_value("Content-Type").find("text/plain"), std::string::npos);
  for (const char* name :
       {"r3_requests_finished_total ", "r3_generation_tokens_total ", "r3_prompt_tokens_total ",
        "r3_steps_total ", "r3_prefix_cache_hit_rate ", "r3_preemptions_total ",
        "r3_route_bytes_returned_total ", "r3_capture_ring_waits_total ",
        "r3_routed_experts_gaps_total 0\n", "r3_step_latency_seconds_count ",
        "r3_step_latency_seconds_bucket{le=\"+Inf\"} ",
        "r3_expert_load_tokens_total{layer=\"1\",expert=\"7\"} ",
        "r3_http_responses_total{endpoint=\"/generate\",code=\"200\"} ",
        "r3_cache_config_info{block_size=\"16\",cache_dtype=\"bf16\"} 1\n",
        // Hybrids' recurrent state: none on this model.
        "r3_recurrent_state_bytes_per_request 0\n", "r3_state_snapshots_total 0\n",
        "r3_state_snapshot_bytes 0\n", "r3_state_snapshot_restores_total 0\n",
        // Speculative decoding: off on this server.
        "r3_spec_decode_num_draft_tokens_total 0\n", "r3_spec_decode_num_accepted_tokens_total 0\n",
        "r3_spec_decode_acceptance_rate 0\n", "r3_spec_decode_steps_off_total 0\n"})
    EXPECT_NE(res->body.find(name), std::string::npos) << name;
  EXPECT_EQ(res->body.find("r3_route_bytes_returned_total 0\n"), std::string::npos);
}

// Every served path is its own label in r3_http_responses_total (chat and /tokenize were
// "other" while the labels were a hand-kept list); a path nothing serves is "other".
TEST_F(ServerTest, MetricsLabelEveryServedPathAndOnlyThose) {
  auto cli = server_->client();
  ASSERT_TRUE(cli.Post("/tokenize", "{}", "application/json"));  // 400: the model has no tokenizer
  ASSERT_TRUE(cli.Get("/v1/loads"));
  ASSERT_TRUE(cli.Get("/no/such/path"));
  auto res = cli.Get("/metrics");
  ASSERT_TRUE(res);
  for (const char* sample : {"r3_http_responses_total{endpoint=\"/tokenize\",code=\"400\"} ",
                             "r3_http_responses_total{endpoint=\"/v1/loads\",code=\"200\"} ",
                             "r3_http_responses_total{endpoint=\"other\",code=\"404\"} "})
    EXPECT_NE(res->body.find(sample), std::string::npos) << sample;
  EXPECT_EQ(res->body.find("/no/such/path"), std::string::npos);
}

// src/server/README.md's endpoint table names exactly the routes the main listener serves, with
// their methods. A cell reads "`POST /a`, `/b`" or "`GET\|POST /c` (`/d`)": a path without a
// method has the one before it.
TEST_F(ServerTest, TheReadmesEndpointTableIsWhatIsServed) {
  std::ifstream in(std::string(R3_SOURCE_DIR) + "/src/server/README.md");
  ASSERT_TRUE(in);
  std::set<std::string> documented, served;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    const std::string cell = line.substr(2, line.find(" | ", 2) - 2);
    std::vector<std::string> methods;
    for (size_t at = cell.find('`'); at != std::string::npos;
         at = cell.find('`', cell.find('`', at + 1) + 1)) {
      std::string item = cell.substr(at + 1, cell.find('`', at + 1) - at - 1);
      if (item[0] != '/') {
        const std::string list = item.substr(0, item.find(' '));
        item = item.substr(item.find(' ') + 1);
        methods.clear();
        for (std::string m : {"GET", "POST"})
          if (list.find(m) != std::string::npos) methods.push_back(m);
      }
      for (const std::string& m : methods) documented.insert(m + " " + item);
    }
  }
  for (const server::ServedEndpoint& e : server_->srv->endpoints())
    if (!e.control) served.insert(e.method + " " + e.path);
  EXPECT_EQ(documented, served);
}

// The README's sentences on open endpoints, the weights body cap and the control port name what
// the endpoint table serves (and every other POST has the request body cap).
TEST_F(ServerTest, TheReadmesAccessCapAndControlListsAreWhatIsServed) {
  std::ifstream in(std::string(R3_SOURCE_DIR) + "/src/server/README.md");
  std::stringstream whole;
  whole << in.rdbuf();
  std::string text = whole.str();
  for (char& c : text)
    if (c == '\n') c = ' ';
  // The `METHOD /path` items between a sentence's start and its full stop.
  auto listed = [&](const std::string& start) {
    std::set<std::string> items;
    const size_t from = text.find(start);
    EXPECT_NE(from, std::string::npos) << start;
    if (from == std::string::npos) return items;
    const size_t end = text.find(". ", from);
    for (size_t at = text.find('`', from); at < end;
         at = text.find('`', text.find('`', at + 1) + 1)) {
      const std::string item = text.substr(at + 1, text.find('`', at + 1) - at - 1);
      if (item.rfind("GET /", 0) == 0 || item.rfind("POST /", 0) == 0) items.insert(item);
    }
    return items;
  };
  std::set<std::string> open, weights_cap, control;
  const server::ServerOptions defaults;
  for (const server::ServedEndpoint& e : server_->srv->endpoints()) {
    const std::string name = e.method + " " + e.path;
    if (e.control) {
      control.insert(name);
      continue;
    }
    if (!e.needs_key) open.insert(name);
    if (e.method != "POST") continue;
    if (e.body_cap == defaults.max_weights_body_bytes) {
      weights_cap.insert(name);
    } else {
      EXPECT_EQ(e.body_cap, defaults.max_body_bytes) << name;
    }
  }
  EXPECT_EQ(listed("Open (no API key):"), open);
  EXPECT_EQ(listed("Bodies up to `--max-weights-body-bytes`:"), weights_cap);
  EXPECT_EQ(listed("The control port (`--control-port`) serves"), control);
}

TEST_F(ServerTest, BadRequestsAre4xxAndServingGoesOn) {
  struct Case {
    std::string path, body;
    int status;
    std::string param;  // "" = null
  };
  const std::string big = json{{"prompt", prompt_of(2000, 1)}, {"max_tokens", 100}}.dump();
  const std::vector<Case> cases = {
      {"/v1/completions", "{\"prompt\": [1, 2", 400, ""},
      {"/v1/completions", "[1, 2]", 400, ""},
      {"/v1/completions", "{}", 400, "prompt"},
      {"/v1/completions", R"({"prompt": "hello world"})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": ["hello", "world"]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": []})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [1, "a"]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [1, 2.5]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [1, 512]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [1, -1]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [1, 99999999999]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [[1, 2], [3, 600]]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [1, 2], "max_tokens": "8"})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": [1, 2], "max_tokens": -1})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": [1, 2], "max_tokens": 5000})", 400, "prompt"},
      {"/v1/completions", big, 400, "prompt"},  // fits the model, not the 128-block KV pool
      {"/v1/completions", R"({"prompt": [1, 2], "temperature": "hot"})", 400, "temperature"},
      {"/v1/completions", R"({"prompt": [1, 2], "temperature": -1})", 400, "temperature"},
      {"/v1/completions", R"({"prompt": [1, 2], "top_p": 0})", 400, "top_p"},
      {"/v1/completions", R"({"prompt": [1, 2], "n": 0})", 400, "n"},
      {"/v1/completions", R"({"prompt": [1, 2], "stream": "yes"})", 400, "stream"},
      {"/v1/completions", R"({"prompt": [1, 2], "seed": -3})", 400, "seed"},
      {"/v1/completions", R"({"prompt": [1, 2], "stop": ["\n"]})", 400, "stop"},
      {"/v1/completions", R"({"prompt": [1, 2], "stop_token_ids": [9999]})", 400, "stop_token_ids"},
      {"/v1/completions", R"({"prompt": [1, 2], "logprobs": 21})", 400, "logprobs"},
      {"/v1/completions", R"({"prompt": [1, 2], "echo": true})", 400, "echo"},
      // Unsupported options are refused before the prompt is read (a text prompt here has no
      // tokenizer to encode it).
      {"/v1/completions", R"({"prompt": "hi", "presence_penalty": 1})", 400, "presence_penalty"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1})", 400,
       "presence_penalty"},
      {"/v1/completions", R"({"prompt": [1, 2], "return_routed_experts": 1})", 400,
       "return_routed_experts"},
      {"/v1/completions", R"({"prompt": [1, 2], "routed_experts_start": 3})", 400,
       "routed_experts_start"},
      {"/v1/completions", R"({"prompt": [1, 2], "max_tokens": 3, "return_routed_experts": true,
                              "routed_experts_start": 9})",
       400, "routed_experts_start"},
      {"/generate", R"({"text": "hi"})", 400, "text"},
      {"/generate", R"({"sampling_params": {}})", 400, "input_ids"},
      {"/generate", R"({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "x"}})", 400,
       "sampling_params.max_new_tokens"},
      {"/generate", R"({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}})", 400,
       "input_ids"},
      {"/generate", R"({"input_ids": [1, 2], "sampling_params": []})", 400, "sampling_params"},
      {"/generate", R"({"input_ids": [1, 2], "sampling_params": {"stop": "x"}})", 400,
       "sampling_params.stop"},
      {"/generate", R"({"input_ids": [1, 2], "rid": {"a": 1}})", 400, "rid"},
      {"/update_weights", R"({})", 400, "model_path"},
      {"/update_weights", R"({"model_path": "/no/such/dir", "bogus": 1})", 400, "bogus"},
      {"/abort", R"({})", 400, "rid"},
      {"/generate", R"({"input_ids": [1], "image_data": "x.png"})", 400, "image_data"},
      {"/generate", R"({"input_ids": [1], "lora_path": "adapter"})", 400, "lora_path"},
      {"/generate", R"({"input_ids": [1], "sampling_params": {"custom_params": {"a": 1}}})", 400,
       "sampling_params.custom_params"},
      {"/generate", R"({"input_ids": [1], "sampling_params": {"min_p": 0.1}})", 400,
       "sampling_params.min_p"},
      {"/generate", R"({"input_ids": [1], "top_logprobs_num": 21})", 400, "top_logprobs_num"},
      {"/generate", R"({"input_ids": [1], "logprob_start_len": -2})", 400, "logprob_start_len"},
      {"/generate",
       R"({"input_ids": [1], "return_routed_experts": true, "routed_experts_start_len": 0,
                       "routed_experts_start": 0})",
       400, "routed_experts_start"},
      {"/v1/completions", R"({"prompt": [1], "prompt_logprobs": 21})", 400, "prompt_logprobs"},
      {"/v1/completions", R"({"prompt": [1], "guided_json": {}})", 400, "guided_json"},
      {"/no_such_endpoint", R"({})", 404, ""},
  };
  auto cli = server_->client();
  for (const Case& c : cases) {
    auto res = cli.Post(c.path.c_str(), c.body, "application/json");
    ASSERT_TRUE(res) << c.body;
    EXPECT_EQ(res->status, c.status) << c.path << " " << c.body << " -> " << res->body;
    json j = json::parse(res->body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << res->body;
    const json& e = j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << res->body;
    EXPECT_TRUE(e["type"].is_string()) << res->body;
    ASSERT_TRUE(e.contains("param")) << res->body;
    if (c.param.empty())
      EXPECT_TRUE(e["param"].is_null()) << c.body << " -> " << res->body;
    else
      EXPECT_EQ(e["param"], c.param) << c.body << " -> " << res->body;
  }
  auto t = cli.Post("/v1/completions", R"({"prompt": "hi"})", "application/json");
  ASSERT_TRUE(t);
  EXPECT_EQ(json::parse(t->body)["error"]["message"],
            "the model has no tokenizer (no tokenizer.json; start r3 serve with --tokenizer DIR); "
            "send token ids");
  // Still serving.
  json ok =
      post("/v1/completions", {{"prompt", {5, 6, 7}}, {"max_tokens", 2}, {"ignore_eos", true}});
  EXPECT_EQ(ok["choices"][0]["token_ids"].size(), 2u);
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

// A second server: API key, no route capture, a small body limit.
TEST(ServerRestricted, ApiKeyNoCaptureAndBodyLimit) {
  EngineConfig c = server_engine_config(test_model("olmoe"));
  c.enable_return_routed_experts = false;
  server::ServerOptions o;
  o.api_key = "sekret";
  o.max_body_bytes = 2048;
  Running s(c, o);
  auto cli = s.client();
  auto h = cli.Get("/health");  // no key needed
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  for (const char* path : {"/v1/models", "/metrics"}) {
    auto r = cli.Get(path);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401) << path;
    EXPECT_EQ(json::parse(r->body)["error"]["type"], "authentication_error");
  }
  const std::string body = R"({"prompt": [5, 6], "max_tokens": 2})";
  auto no = cli.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(no);
  EXPECT_EQ(no->status, 401);
  auto wrong =
      cli.Post("/v1/completions", {{"Authorization", "Bearer nope"}}, body, "application/json");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  auto gen = cli.Post("/generate", {{"Authorization", "Bearer sekret2"}}, R"({"input_ids": [1]})",
                      "application/json");
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->status, 401);

  cli.set_bearer_token_auth("sekret");
  auto ok = cli.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  auto models = cli.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200);

  // Routes asked of an engine started without capture: a 400, not an empty answer.
  auto routes = cli.Post("/v1/completions", R"({"prompt": [5, 6], "return_routed_experts": true})",
                         "application/json");
  ASSERT_TRUE(routes);
  EXPECT_EQ(routes->status, 400);
  EXPECT_EQ(json::parse(routes->body)["error"]["param"], "return_routed_experts");

  // Oversized body: 413 with the JSON error body.
  json huge = {{"prompt", prompt_of(1000, 3)}};
  auto big = cli.Post("/v1/completions", huge.dump(), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_EQ(json::parse(big->body, nullptr, false)["error"]["type"], "request_too_large")
      << big->body;

  auto again = cli.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200);
}

// Raw HTTP over a loopback socket: what the client wrote, and everything the server answered
// until it closed the connection or `stop_at` appeared.
std::string raw_exchange(int port, const std::string& request,
                         const std::string& stop_at = "\r\n\r\n{") {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return "";
  size_t off = 0;
  while (off < request.size()) {
    ssize_t n = send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may close early: that is the point
    off += size_t(n);
  }
  std::string got;
  char buf[4096];
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    got.append(buf, size_t(n));
    const size_t at = got.find(stop_at);
    if (at != std::string::npos && got.find('}', at) != std::string::npos) break;
  }
  close(fd);
  return got;
}

// A chunked body carries no length up front: it is still capped at --max-body-bytes (413), and
// the API key is checked before any of it is read (401).
TEST(ServerBounds, ChunkedBodiesAreCappedAndAuthComesFirst) {
  server::ServerOptions o;
  o.max_body_bytes = 4096;
  o.api_key = "k";
  Running s(server_engine_config(test_model("olmoe")), o);
  std::string chunks;
  for (int i = 0; i < 64; ++i)
    chunks += "400\r\n" + std::string(1024, ' ') + "\r\n";  // 64 KiB of spaces
  chunks += "0\r\n\r\n";
  const std::string head =
      "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Transfer-Encoding: chunked\r\n";
  const std::string big = raw_exchange(s.port, head + "Authorization: Bearer k\r\n\r\n" + chunks);
  EXPECT_NE(big.find(" 413 "), std::string::npos) << big.substr(0, 200);
  EXPECT_NE(big.find("request_too_large"), std::string::npos) << big.substr(0, 400);
  const std::string anon = raw_exchange(s.port, head + "\r\n" + chunks);
  EXPECT_NE(anon.find(" 401 "), std::string::npos) << anon.substr(0, 200);
  // A small chunked body is read whole and served.
  const std::string body = R"({"input_ids":[5,6],"sampling_params":{"max_new_tokens":2}})";
  char len[16];
  std::snprintf(len, sizeof len, "%zx", body.size());
  const std::string ok =
      raw_exchange(s.port, head + "Authorization: Bearer k\r\n\r\n" + std::string(len) + "\r\n" +
                               body + "\r\n0\r\n\r\n");
  EXPECT_NE(ok.find(" 200 "), std::string::npos) << ok.substr(0, 300);
  auto cli = s.client();
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

// A deeply nested body is refused before it is parsed (its memory would be far beyond its size).
TEST(ServerBounds, DeeplyNestedJsonIsRefused) {
  Running s(server_engine_config(test_model("olmoe")));
  auto cli = s.client();
  const std::string deep =
      "{\"input_ids\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  auto r = cli.Post("/generate", deep, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("nested deeper"), std::string::npos) << r->body.substr(0, 300);
}

// A /generate call of n new tokens on its own thread; reply() waits for its JSON reply.
struct BackgroundGenerate {
  json result;
  std::thread t;
  BackgroundGenerate(const Running& s, int n, int salt) {
    t = std::thread([this, &s, n, salt] {
      auto cli = s.client();
      auto r = cli.Post("/generate",
                        json{{"input_ids", prompt_of(8, salt)},
                             {"sampling_params", {{"max_new_tokens", n}, {"ignore_eos", true}}}}
                            .dump(),
                        "application/json");
      if (r) result = json::parse(r->body, nullptr, false);
    });
  }
  const json& reply() {
    t.join();
    return result;
  }
};

void wait_until_running(const Running& s) {
  auto cli = s.client();
  for (int i = 0; i < 1000; ++i) {
    auto m = cli.Get("/metrics");
    if (m && m->body.find("\nr3_requests_running 1") != std::string::npos) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "the request never started running";
}

// SIGTERM's path: requests in flight finish normally, new ones get 503, /health says 503, and
// what outlives the grace period is aborted (its caller gets the abort reply, not an error).
TEST(ServerBounds, GracefulShutdownDrainsInFlightRequests) {
  // The small preset decodes 2000 tokens in about a second: long enough to drain under test.
  server::ServerOptions o;
  o.control_port = 0;
  Running s(server_engine_config(test_model("olmoe", "small")), o);
  BackgroundGenerate a(s, 2000, 1);
  wait_until_running(s);
  std::thread stopper([&] { s.srv->shutdown(std::chrono::seconds(60)); });
  httplib::Client ctl("127.0.0.1", s.srv->control_port());
  bool refused = false, unhealthy = false;
  for (int i = 0; i < 2000 && !(refused && unhealthy); ++i) {
    auto h = ctl.Get("/health");
    unhealthy = unhealthy || (h && h->status == 503);
    auto cli = s.client();
    auto g = cli.Post("/generate", R"({"input_ids":[5,6],"sampling_params":{"max_new_tokens":1}})",
                      "application/json");
    refused =
        refused || (g && g->status == 503 && g->body.find("shutting down") != std::string::npos);
  }
  const json& finished = a.reply();
  stopper.join();
  EXPECT_TRUE(refused) << "a new request was admitted while draining";
  EXPECT_TRUE(unhealthy) << "/health said ok while draining";
  ASSERT_TRUE(finished.is_object()) << finished.dump();
  EXPECT_EQ(finished["meta_info"]["finish_reason"]["type"], "length") << finished.dump();
  EXPECT_EQ(finished["output_ids"].size(), 2000u);

  // Grace 0: a long request is aborted, its caller answered with finish reason abort.
  Running s2(server_engine_config(test_model("olmoe", "small")));
  BackgroundGenerate b(s2, 2000, 2);
  wait_until_running(s2);
  EXPECT_EQ(s2.srv->shutdown(std::chrono::milliseconds(0)), 1u);
  const json& cut = b.reply();
  ASSERT_TRUE(cut.is_object()) << cut.dump();
  EXPECT_EQ(cut["meta_info"]["finish_reason"]["type"], "abort") << cut.dump();
}

// Idle clients holding every HTTP thread of the main port: the control port still answers
// /health, /metrics and /abort at once, and the main port frees its slots after the read timeout.
TEST(ServerBounds, ControlPortAnswersWhileSlowClientsHoldEveryConnection) {
  server::ServerOptions o;
  o.control_port = 0;
  o.read_timeout_seconds = 1;
  o.http_threads = 4;
  EngineConfig c = server_engine_config(test_model("olmoe"));
  o.port = 0;
  server::Server srv(c, o);
  const int port = srv.start();
  ASSERT_GT(srv.control_port(), 0);
  std::vector<int> idle;
  for (int i = 0; i < 12; ++i) {  // connect and send half a request line, then nothing
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(send(fd, "GET /hea", 8, MSG_NOSIGNAL), 8);
    idle.push_back(fd);
  }
  httplib::Client ctl("127.0.0.1", srv.control_port());
  ctl.set_read_timeout(1, 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto h = ctl.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  auto ab = ctl.Post("/abort", R"({"rid":"nothing"})", "application/json");
  ASSERT_TRUE(ab);
  EXPECT_EQ(ab->status, 200);
  auto m = ctl.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("r3_requests_running"), std::string::npos);
  EXPECT_FALSE(ctl.Get("/v1/models") &&
               ctl.Get("/v1/models")->status == 200);  // control serves control only
  // The main port gets its threads back once the slow clients time out.
  httplib::Client main_cli("127.0.0.1", port);
  main_cli.set_read_timeout(10, 0);
  main_cli.set_connection_timeout(10, 0);
  auto mh = main_cli.Get("/health");
  ASSERT_TRUE(mh);
  EXPECT_EQ(mh->status, 200);
  for (int fd : idle) close(fd);
  srv.stop();
}

// A step that runs longer than the stall limit turns /health to 503 while it runs.
TEST(ServerBounds, HealthReportsAStalledEngineStep) {
  server::ServerOptions o;
  o.stall_seconds = 1e-9;  // every step in progress counts as stalled
  o.control_port = 0;
  Running s(server_engine_config(test_model("olmoe", "small")), o);
  std::atomic<bool> done{false};
  std::thread gen([&] {
    auto cli = s.client();
    cli.Post("/generate",
             json{{"input_ids", prompt_of(8, 4)},
                  {"sampling_params", {{"max_new_tokens", 1000}, {"ignore_eos", true}}}}
                 .dump(),
             "application/json");
    done = true;
  });
  httplib::Client ctl("127.0.0.1", s.srv->control_port());
  bool stalled = false;
  while (!done && !stalled) {
    auto h = ctl.Get("/health");
    stalled = h && h->status == 503 && h->body.find("stalled") != std::string::npos;
  }
  gen.join();
  EXPECT_TRUE(stalled);
  bool ok = false;  // idle again (no step runs): ok
  for (int i = 0; i < 200 && !ok; ++i) {
    auto h = ctl.Get("/health");
    ok = h && h->status == 200;
    if (!ok) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(ok);
}

// A refit from a path that would block (a FIFO shard) is refused at once; generation goes on.
TEST(ServerRefit, BlockingPathIsRefusedWithoutStallingGeneration) {
  Running s(server_engine_config(test_model("olmoe")));
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("r3_fifo_refit_" + std::to_string(getpid())))
          .string();
  std::filesystem::remove_all(dir);
  std::filesystem::copy(test_model("olmoe"), dir, std::filesystem::copy_options::recursive);
  const std::string shard = dir + "/model.safetensors";
  std::filesystem::remove(shard);
  ASSERT_EQ(::mkfifo(shard.c_str(), 0600), 0);
  auto cli = s.client();
  const auto t0 = std::chrono::steady_clock::now();
  auto r = cli.Post("/update_weights", json{{"model_path", dir}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["success"], false);
  EXPECT_NE(r->body.find("not a regular file"), std::string::npos) << r->body;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  auto g = cli.Post(
      "/generate",
      json{{"input_ids", prompt_of(5, 2)}, {"sampling_params", {{"max_new_tokens", 3}}}}.dump(),
      "application/json");
  ASSERT_TRUE(g);
  EXPECT_EQ(g->status, 200);
  EXPECT_EQ(json::parse(g->body)["meta_info"]["weight_version"], "0");
  std::filesystem::remove_all(dir);
}

// SGLang's control plane as slime drives it around a weight sync: health_generate until 200,
// pause → flush_cache → update_weights_from_disk with a string version → continue →
// get_weight_version; replies equal a solo run on the new weights.
TEST(ServerControl, SlimeWeightSyncSequence) {
  const std::string m0 = test_model("olmoe"), m1 = test_model("olmoe", "tiny", 1);
  Running s(server_engine_config(m0));
  auto cli = s.client();
  auto h = cli.Get("/health_generate");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto info = cli.Get("/get_server_info");
  ASSERT_TRUE(info);
  json si = json::parse(info->body);
  EXPECT_EQ(si["model_path"], m0);
  EXPECT_EQ(si["max_running_requests"], 8);
  EXPECT_EQ(si["internal_states"].size(), 1u);
  EXPECT_EQ(json::parse(cli.Get("/server_info")->body)["model_path"], m0);
  json mi = json::parse(cli.Get("/get_model_info")->body);
  EXPECT_EQ(mi["model_path"], m0);
  EXPECT_EQ(mi["is_generation"], true);
  // r3's whole description (model_config_json), the same object Python's LLM.model_config holds.
  const json& desc = mi["r3_model_config"];
  EXPECT_EQ(desc["num_layers"].get<size_t>(), desc["layers"].size());
  EXPECT_TRUE(desc["router"].contains("n_group"));
  EXPECT_TRUE(desc["layers"][0]["attention"].contains("sliding_window"));
  EXPECT_EQ(json::parse(cli.Get("/get_weight_version")->body)["weight_version"], "0");

  for (const char* mode : {"abort", "in_place", "retract"}) {
    SCOPED_TRACE(mode);
    auto p = cli.Post("/pause_generation", json{{"mode", mode}}.dump(), "application/json");
    ASSERT_TRUE(p);
    EXPECT_EQ(p->status, 200) << p->body;
    EXPECT_EQ(json::parse(p->body)["status"], "ok");
    auto f = cli.Get("/flush_cache");
    ASSERT_TRUE(f);
    EXPECT_EQ(f->status, 200) << f->body;  // nothing runs: flushed
    auto c = cli.Post("/continue_generation", "{}", "application/json");
    ASSERT_TRUE(c);
    EXPECT_EQ(c->status, 200);
  }
  auto bad = cli.Post("/pause_generation", R"({"mode":"sideways"})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);

  ASSERT_EQ(cli.Post("/pause_generation", "{}", "application/json")->status, 200);  // mode abort
  ASSERT_EQ(cli.Post("/flush_cache", "", "text/plain")->status, 200);
  auto u = cli.Post("/update_weights_from_disk",
                    json{{"model_path", m1}, {"weight_version", "v7"}}.dump(), "application/json");
  ASSERT_TRUE(u);
  ASSERT_EQ(u->status, 200) << u->body;
  json uj = json::parse(u->body);
  EXPECT_EQ(uj["success"], true);
  EXPECT_EQ(uj["num_paused_requests"], 0);
  EXPECT_NE(uj["message"].get<std::string>().find("v7"), std::string::npos);
  ASSERT_EQ(cli.Post("/continue_generation", "{}", "application/json")->status, 200);
  EXPECT_EQ(json::parse(cli.Get("/get_weight_version")->body)["weight_version"], "v7");

  json req = {
      {"input_ids", prompt_of(12, 5)},
      {"sampling_params", {{"max_new_tokens", 6}, {"temperature", 0.0}, {"ignore_eos", true}}},
      {"return_routed_experts", true}};
  auto g = cli.Post("/generate", req.dump(), "application/json");
  ASSERT_TRUE(g);
  ASSERT_EQ(g->status, 200);
  json gj = json::parse(g->body);
  EXPECT_EQ(gj["meta_info"]["weight_version"], "v7");
  EngineConfig sc = testing::solo_config(m1);
  Engine solo(sc);
  SamplingParams p = testing::greedy(6);
  const RequestOutput want = solo.generate({prompt_of(12, 5)}, {p})[0];
  EXPECT_EQ(gj["output_ids"].get<std::vector<int>>(), want.token_ids);
  // A failed refit keeps the old weights and label: 400 {"success": false}.
  auto f = cli.Post("/update_weights_from_disk",
                    json{{"model_path", "/no/such"}, {"weight_version", "v8"}}.dump(),
                    "application/json");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->status, 400);
  EXPECT_EQ(json::parse(f->body)["success"], false);
  EXPECT_EQ(json::parse(cli.Get("/get_weight_version")->body)["weight_version"], "v7");
  auto v = cli.Post("/update_weight_version", R"({"new_version":"v9"})", "application/json");
  ASSERT_TRUE(v);
  EXPECT_EQ(json::parse(v->body)["new_version"], "v9");
  EXPECT_EQ(json::parse(cli.Get("/weight_version")->body)["weight_version"], "v9");
  EXPECT_NE(cli.Get("/metrics")->body.find("r3_weight_version_info{weight_version=\"v9\"} 1"),
            std::string::npos);
  json loads = json::parse(cli.Get("/v1/loads")->body);
  EXPECT_EQ(loads["loads"][0]["num_running_reqs"], 0);
  EXPECT_EQ(loads["loads"][0]["num_waiting_reqs"], 0);
}

// Pause modes with a request in flight: in_place keeps it (flush refused while it waits), and
// after continue it ends as its solo run; retract frees its KV and it still ends as its solo run;
// abort ends it with finish reason abort.
TEST(ServerControl, PauseModesWithARequestInFlight) {
  const std::string model = test_model("olmoe", "small");
  EngineConfig sc = testing::solo_config(model);
  sc.num_kv_blocks = 128;
  Engine solo(sc);
  const RequestOutput want = solo.generate({prompt_of(8, 3)}, {testing::greedy(1500, false)})[0];
  for (const char* mode : {"in_place", "retract", "abort"}) {
    SCOPED_TRACE(mode);
    Running s(server_engine_config(model));
    json reply;
    std::thread t([&] {
      auto c = s.client();
      auto r = c.Post("/generate",
                      json{{"input_ids", prompt_of(8, 3)},
                           {"sampling_params",
                            {{"max_new_tokens", 1500}, {"temperature", 0.0}, {"ignore_eos", true}}}}
                          .dump(),
                      "application/json");
      if (r) reply = json::parse(r->body, nullptr, false);
    });
    auto cli = s.client();
    for (int i = 0; i < 1000; ++i) {
      auto m = cli.Get("/metrics");
      if (m && m->body.find("\nr3_requests_running 1") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_EQ(
        cli.Post("/pause_generation", json{{"mode", mode}}.dump(), "application/json")->status,
        200);
    json l = json::parse(cli.Get("/v1/loads")->body)["loads"][0];
    auto f = cli.Get("/flush_cache");
    ASSERT_TRUE(f);
    if (std::string(mode) == "abort") {
      EXPECT_EQ(l["num_running_reqs"].get<int>() + l["num_waiting_reqs"].get<int>(), 0);
      EXPECT_EQ(f->status, 200);
    } else {
      EXPECT_EQ(f->status, 400) << f->body;  // the request still holds or awaits its KV
      if (std::string(mode) == "retract")
        EXPECT_EQ(l["num_waiting_reqs"], 1);
      else
        EXPECT_EQ(l["num_running_reqs"], 1);
    }
    // Paused: health_generate cannot get a token (its request waits), so it answers 503 fast here.
    ASSERT_EQ(cli.Post("/continue_generation", "{}", "application/json")->status, 200);
    t.join();
    ASSERT_TRUE(reply.is_object()) << reply.dump();
    if (std::string(mode) == "abort") {
      EXPECT_EQ(reply["meta_info"]["finish_reason"]["type"], "abort");
    } else {
      EXPECT_EQ(reply["meta_info"]["finish_reason"]["type"], "length");
      EXPECT_EQ(reply["output_ids"].get<std::vector<int>>(), want.token_ids);
    }
  }
}

// While paused, an abort still reaches its caller at once (no step runs), health_generate says
// 503 at once, and flush_cache works once the aborted request is gone.
// --incremental-streaming-output (SGLang's flag): each streamed /generate chunk holds only what is
// new (output_ids, output_token_logprobs, weight_versions, route rows with their
// routed_experts_start_len), the counts stay whole, and the chunks concatenate to the
// non-streamed reply, in every route format, over seeded prompts, starts and lengths.
TEST(ServerIncremental, StreamedGenerateChunksConcatenateToTheReply) {
  server::ServerOptions o;
  o.incremental_streaming_output = true;
  Running s(server_engine_config(test_model("olmoe")), o);
  std::mt19937 rng(46);
  const char* formats[] = {"r3", "sglang", "vllm", "nrlre1"};
  for (int trial = 0; trial < 8; ++trial) {
    const int P = std::uniform_int_distribution<int>(2, 50)(rng);
    const int start = std::uniform_int_distribution<int>(0, P)(rng);
    const int max_new = std::uniform_int_distribution<int>(1, 40)(rng);
    const std::string fmt = formats[trial % 4];
    SCOPED_TRACE("trial " + std::to_string(trial) + " " + fmt);
    json g = {{"input_ids", prompt_of(P, 200 + trial)},
              {"sampling_params",
               {{"max_new_tokens", max_new},
                {"temperature", 0.9},
                {"seed", trial},
                {"ignore_eos", true}}},
              {"return_routed_experts", true},
              {"routed_experts_start_len", start},
              {"routed_experts_format", fmt}};
    auto cli = s.client();
    auto whole_res = cli.Post("/generate", g.dump(), "application/json");
    ASSERT_TRUE(whole_res && whole_res->status == 200);
    const json whole = json::parse(whole_res->body);
    g["stream"] = true;
    auto res = cli.Post("/generate", g.dump(), "application/json");
    ASSERT_TRUE(res && res->status == 200);
    bool done = false;
    const std::vector<json> events = sse_events(res->body, &done);
    ASSERT_TRUE(done);
    json ids = json::array(), logprobs = json::array(), versions = json::array();
    RouteArray rows;
    int next_row = start;
    for (const json& ev : events) {
      for (const auto& x : ev["output_ids"]) ids.push_back(x);
      for (const auto& x : ev["meta_info"]["output_token_logprobs"]) logprobs.push_back(x);
      for (const auto& x : ev["meta_info"]["weight_versions"]) versions.push_back(x);
      EXPECT_EQ(ev["meta_info"]["completion_tokens"], ids.size());
      if (!ev["meta_info"]["routed_experts"].is_null()) {
        EXPECT_EQ(ev["meta_info"]["routed_experts_start_len"],
                  next_row);  // each chunk's rows follow the last's
        const RouteArray part = chunk_routes(ev["meta_info"]);
        next_row += part.rows;
        append_rows(rows, part);
      }
      // Rows come with their tokens: after a chunk, those of every position but the newest.
      if (ev["meta_info"]["finish_reason"].is_null()) {
        EXPECT_EQ(next_row, std::max(start, P + int(ids.size()) - 1))
            << "after " << ids.size() << " tokens";
      }
    }
    EXPECT_EQ(ids, whole["output_ids"]);
    EXPECT_EQ(logprobs, whole["meta_info"]["output_token_logprobs"]);
    EXPECT_EQ(versions, whole["meta_info"]["weight_versions"]);
    EXPECT_EQ(events.back()["meta_info"]["finish_reason"], whole["meta_info"]["finish_reason"]);
    EXPECT_EQ(rows.data, chunk_routes(whole["meta_info"]).data);
  }
}

// A 512-expert model (Qwen3.5-397B's count) at top-10 and top-22: routes come back intact in
// every wire format (SGLang's int32, vLLM's .npy, r3's transport and NeMo-RL's envelope each
// stating a type wide enough: int16), equal to the engine's own; a uint8 payload would have
// wrapped ids past 255 (prime-rl #3051).
TEST(ServerWideRoutes, FiveHundredTwelveExpertsRoundTripInEveryFormat) {
  // Qwen3-MoE at top-10 and top-22, and the hybrid Qwen3.5-397B's routing (512 experts, top-10,
  // every layer MoE, DeltaNet layers between the attention ones).
  for (const auto& [arch, k] : std::vector<std::pair<std::string, int>>{
           {"qwen3_moe", 10}, {"qwen3_moe", 22}, {"qwen3_5_moe_text", 10}}) {
    const std::string dir =
        (std::filesystem::temp_directory_path() /
         ("r3_512x" + std::to_string(k) + "_" + arch + "_" + std::to_string(getpid())))
            .string();
    make_model({.arch = arch,
                .preset = "tiny",
                .seed = 3,
                .out = dir,
                .config_patch = json{{"num_experts", 512}, {"num_experts_per_tok", k}}.dump()});
    const std::vector<int> prompt = prompt_of(20, k);
    SamplingParams p = testing::greedy(8);
    const RouteArray want =
        *Engine(testing::solo_config(dir)).generate({prompt}, {p})[0].routed_experts;
    ASSERT_EQ(want.k, k);
    EXPECT_GT(*std::max_element(want.data.begin(), want.data.end()),
              255);  // ids a uint8 would wrap
    {
      Running s(server_engine_config(dir));
      for (const char* fmt : {"r3", "sglang", "vllm", "nrlre1"}) {
        SCOPED_TRACE(arch + " " + fmt + " top-" + std::to_string(k));
        const json g = {
            {"input_ids", prompt},
            {"sampling_params", {{"max_new_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}}},
            {"return_routed_experts", true},
            {"routed_experts_format", fmt}};
        auto res = s.client().Post("/generate", g.dump(), "application/json");
        ASSERT_TRUE(res && res->status == 200) << (res ? res->body : "");
        const json meta = json::parse(res->body)["meta_info"];
        const std::optional<RouteArray> got = decode_routes(meta, prompt.size(), dir);
        ASSERT_TRUE(got);
        EXPECT_EQ(got->data, want.data);
        if (std::string(fmt) == "r3") {
          EXPECT_EQ(meta["routed_experts"]["dtype"], "int16");
        }
        if (std::string(fmt) == "nrlre1") {
          EXPECT_EQ(meta["routed_experts"].get<std::string>().rfind("nrlre1:int16:", 0), 0u);
        }
      }
    }
    std::filesystem::remove_all(dir);
  }
}

TEST(ServerControl, AbortsWhilePausedAreAnswered) {
  Running s(server_engine_config(test_model("olmoe", "small")));
  auto cli = s.client();
  ASSERT_EQ(cli.Post("/pause_generation", R"({"mode":"in_place"})", "application/json")->status,
            200);
  json reply;
  std::thread t([&] {
    auto c = s.client();
    auto r =
        c.Post("/generate",
               R"({"input_ids":[3,4,5],"sampling_params":{"max_new_tokens":5},"rid":"queued"})",
               "application/json");
    if (r) reply = json::parse(r->body, nullptr, false);
  });
  for (int i = 0; i < 500; ++i) {
    if (json::parse(cli.Get("/v1/loads")->body)["loads"][0]["num_waiting_reqs"] == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto h = cli.Get("/health_generate");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(cli.Get("/flush_cache")->status, 400);  // the queued request is still there
  ASSERT_EQ(cli.Post("/abort_request", R"({"rid":"queued"})", "application/json")->status, 200);
  t.join();
  ASSERT_TRUE(reply.is_object());
  EXPECT_EQ(reply["meta_info"]["finish_reason"]["type"], "abort");
  EXPECT_EQ(cli.Get("/flush_cache")->status, 200);
  ASSERT_EQ(cli.Post("/continue_generation", "{}", "application/json")->status, 200);
}

// release_memory_occupation gives the KV cache and the packed weights back to the OS (RSS drops),
// refuses while requests run, and resume rebuilds them: replies equal those before.
TEST(ServerControl, ReleaseAndResumeMemoryOccupation) {
  auto rss = [] {
    std::ifstream f("/proc/self/statm");
    long pages = 0, resident = 0;
    f >> pages >> resident;
    return resident * sysconf(_SC_PAGESIZE);
  };
  EngineConfig c = server_engine_config(test_model("olmoe", "small"));
  c.num_kv_blocks = 4096;  // a KV cache large enough to see
  Running s(c);
  auto cli = s.client();
  json req = {
      {"input_ids", prompt_of(10, 8)},
      {"sampling_params", {{"max_new_tokens", 5}, {"temperature", 0.0}, {"ignore_eos", true}}}};
  const json before = json::parse(cli.Post("/generate", req.dump(), "application/json")->body);
  const long rss0 = rss();
  auto r = cli.Post("/release_memory_occupation", "{}", "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const long rss1 = rss();
  std::printf("[ release_memory_occupation ] RSS %.1f MB -> %.1f MB\n", rss0 / 1e6, rss1 / 1e6);
  EXPECT_LT(rss1, rss0 - (16l << 20)) << "RSS did not drop";
  json info = json::parse(cli.Get("/get_server_info")->body);
  EXPECT_EQ(info["internal_states"][0]["memory_released"], true);
  auto bad = cli.Post("/resume_memory_occupation", R"({"tags":["gpu_magic"]})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  ASSERT_EQ(cli.Post("/resume_memory_occupation", R"({"tags":["kv_cache","weights"]})",
                     "application/json")
                ->status,
            200);
  const json after = json::parse(cli.Post("/generate", req.dump(), "application/json")->body);
  EXPECT_EQ(after["output_ids"], before["output_ids"]);
  EXPECT_EQ(after["meta_info"]["output_token_logprobs"],
            before["meta_info"]["output_token_logprobs"]);
}

// The four wire formats carry the same routes on both endpoints, on a model with a dense first
// layer: sglang's layer axis is every decoder layer (the dense one all 0, as SGLang leaves it),
// the others hold the MoE layers only; vllm splits prompt and generated rows.
TEST(ServerRoutes, AllFourFormatsCarryTheSameRoutes) {
  const std::string model = test_model("qwen3_moe", "small");
  const ModelConfig c = load_config(model + "/config.json");
  ASSERT_FALSE(c.layers[0].moe);
  Running s(server_engine_config(model));
  auto cli = s.client();
  const std::vector<int> prompt = prompt_of(11, 6);
  Engine solo(testing::solo_config(model));
  const RequestOutput want = solo.generate({prompt}, {testing::greedy(5)})[0];
  const int start = 3;
  for (const char* fmt : {"r3", "sglang", "vllm", "nrlre1"}) {
    SCOPED_TRACE(fmt);
    json g = json::parse(
        cli.Post("/generate",
                 json{{"input_ids", prompt},
                      {"sampling_params",
                       {{"max_new_tokens", 5}, {"temperature", 0.0}, {"ignore_eos", true}}},
                      {"return_routed_experts", true},
                      {"routed_experts_start_len", start},
                      {"routed_experts_format", fmt}}
                     .dump(),
                 "application/json")
            ->body);
    json cmp = json::parse(cli.Post("/v1/completions",
                                    json{{"prompt", prompt},
                                         {"max_tokens", 5},
                                         {"temperature", 0.0},
                                         {"ignore_eos", true},
                                         {"return_routed_experts", true},
                                         {"routed_experts_start", start},
                                         {"routed_experts_format", fmt}}
                                        .dump(),
                                    "application/json")
                               ->body);
    json choice = cmp["choices"][0];
    choice["routed_experts_start_len"] = start;
    for (const json* obj : {&g["meta_info"], &choice}) {
      ASSERT_EQ((*obj)["routed_experts_format"], fmt) << obj->dump().substr(0, 300);
      const std::optional<RouteArray> got = decode_routes(*obj, prompt.size(), model);
      ASSERT_TRUE(got);
      ASSERT_EQ(got->rows, int(prompt.size()) + 5 - 1 - start);
      ASSERT_EQ(got->layers, c.num_moe_layers());
      for (int r = 0; r < got->rows; ++r)
        for (int i = 0; i < got->layers * got->k; ++i)
          ASSERT_EQ(got->row(r)[i], want.routed_experts->row(r + start)[i]) << "row " << r;
    }
    if (std::string(fmt) == "sglang") {
      const std::vector<uint8_t> raw =
          base64_decode(g["meta_info"]["routed_experts"].get<std::string>());
      const size_t row = size_t(c.num_layers) * size_t(c.top_k) * 4;
      ASSERT_EQ(raw.size(), size_t(int(prompt.size()) + 5 - 1 - start) * row);
      for (size_t r = 0; r * row < raw.size(); ++r)
        for (size_t b = 0; b < size_t(c.top_k) * 4; ++b)
          ASSERT_EQ(raw[r * row + b], 0) << "dense layer 0, row " << r;
    }
    if (std::string(fmt) == "vllm") {
      EXPECT_EQ(cmp["prompt_routed_experts"], cmp["choices"][0]["prompt_routed_experts"]);
    }
  }
  auto bad = cli.Post("/generate", R"({"input_ids":[1],"routed_experts_format":"protobuf"})",
                      "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"]["param"], "routed_experts_format");
}

// Weights over HTTP as safetensors bytes, in two buckets: the first stages, the second (finished)
// applies both with a string version; a malformed or mismatched bucket is a 400 that changes
// nothing.
TEST(ServerRefit, UpdateWeightsFromTensorInBuckets) {
  const std::string m0 = test_model("olmoe"), m1 = test_model("olmoe", "tiny", 1);
  server::ServerOptions o;
  o.max_body_bytes = 4096;  // weights travel under their own, larger cap
  Running s(server_engine_config(m0), o);
  auto cli = s.client();
  std::vector<TensorToWrite> halves[2];
  size_t i = 0;
  for (TensorToWrite& t : read_safetensors(m1 + "/model.safetensors"))
    halves[i++ % 2].push_back(std::move(t));
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("r3_wsync_" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(dir);
  std::string bodies[2];
  for (int h = 0; h < 2; ++h) {
    write_safetensors(dir + "/b.safetensors", halves[h]);
    std::ifstream in(dir + "/b.safetensors", std::ios::binary);
    bodies[h].assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto bad = cli.Post("/update_weights_from_tensor", "not safetensors", "application/octet-stream");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["success"], false);
  auto r1 =
      cli.Post("/update_weights_from_tensor?finished=false", bodies[0], "application/octet-stream");
  ASSERT_TRUE(r1);
  ASSERT_EQ(r1->status, 200) << r1->body;
  EXPECT_EQ(json::parse(r1->body)["weight_version"], "0");  // staged only
  auto r2 = cli.Post("/update_weights_from_tensor?finished=true&weight_version=step-1", bodies[1],
                     "application/octet-stream");
  ASSERT_TRUE(r2);
  ASSERT_EQ(r2->status, 200) << r2->body;
  EXPECT_EQ(json::parse(r2->body)["num_tensors"], halves[0].size() + halves[1].size());
  EXPECT_EQ(json::parse(cli.Get("/get_weight_version")->body)["weight_version"], "step-1");
  const std::vector<int> prompt = prompt_of(9, 4);
  json g = json::parse(
      cli.Post("/generate",
               json{{"input_ids", prompt},
                    {"sampling_params",
                     {{"max_new_tokens", 5}, {"temperature", 0.0}, {"ignore_eos", true}}}}
                   .dump(),
               "application/json")
          ->body);
  Engine solo1(testing::solo_config(m1));
  EXPECT_EQ(g["output_ids"].get<std::vector<int>>(),
            solo1.generate({prompt}, {testing::greedy(5, false)})[0].token_ids);
  std::filesystem::remove_all(dir);
}

// AReaL's scoring call: the whole sequence as input_ids, max_new_tokens 1 (or 0), return_logprob
// with logprob_start_len 0; input_token_logprobs[i] is the logprob of token i given the tokens
// before it — the same bits as when the engine generated that token.
TEST(ServerScoring, ArealScoringCall) {
  const std::string model = test_model("olmoe", "small");
  Running s(server_engine_config(model));
  auto cli = s.client();
  const std::vector<int> a = prompt_of(9, 3);
  json gen = json::parse(
      cli.Post("/generate",
               json{{"input_ids", a},
                    {"sampling_params",
                     {{"max_new_tokens", 10}, {"temperature", 0.0}, {"ignore_eos", true}}},
                    {"top_logprobs_num", 3}}
                   .dump(),
               "application/json")
          ->body);
  std::vector<int> seq = a;
  for (auto& t : gen["output_ids"]) seq.push_back(t.get<int>());
  ASSERT_EQ(gen["meta_info"]["output_top_logprobs"].size(), 10u);
  EXPECT_EQ(gen["meta_info"]["output_top_logprobs"][0][0][1],
            gen["output_ids"][0]);  // greedy = best
  for (int max_new : {1, 0}) {
    SCOPED_TRACE(max_new);
    json sc = json::parse(
        cli.Post("/generate",
                 json{{"input_ids", seq},
                      {"sampling_params", {{"max_new_tokens", max_new}, {"temperature", 0.0}}},
                      {"return_logprob", true},
                      {"logprob_start_len", 0},
                      {"return_routed_experts", true}}
                     .dump(),
                 "application/json")
            ->body);
    const json& in = sc["meta_info"]["input_token_logprobs"];
    ASSERT_EQ(in.size(), seq.size()) << sc.dump().substr(0, 400);
    EXPECT_TRUE(in[0][0].is_null());
    for (size_t i = 0; i < seq.size(); ++i) EXPECT_EQ(in[i][1], seq[i]);
    for (size_t i = 0; i < 10; ++i)
      EXPECT_EQ(in[a.size() + i][0].get<double>(),
                gen["meta_info"]["output_token_logprobs"][i][0].get<double>())
          << i;
    EXPECT_EQ(sc["output_ids"].size(), size_t(max_new));
    const std::optional<RouteArray> routes = decode_routes(sc["meta_info"], seq.size(), model);
    ASSERT_TRUE(routes);
    EXPECT_EQ(routes->rows, int(seq.size()) + max_new - 1);
  }
}

// vLLM's scoring on /v1/completions: logprobs k (top alternatives as "token_id:N") and
// prompt_logprobs (one entry per prompt position), max_tokens 0.
TEST(ServerScoring, CompletionsLogprobsAndPromptLogprobs) {
  Running s(server_engine_config(test_model("olmoe")));
  auto cli = s.client();
  const std::vector<int> a = prompt_of(7, 5);
  json g = json::parse(cli.Post("/v1/completions",
                                json{{"prompt", a},
                                     {"max_tokens", 6},
                                     {"temperature", 0.0},
                                     {"ignore_eos", true},
                                     {"logprobs", 3}}
                                    .dump(),
                                "application/json")
                           ->body);
  const json& lp = g["choices"][0]["logprobs"];
  ASSERT_EQ(lp["top_logprobs"].size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(lp["top_logprobs"][i].size(), 3u);
    EXPECT_EQ(lp["top_logprobs"][i][lp["tokens"][i].get<std::string>()],
              lp["token_logprobs"][i]);  // greedy: best
  }
  std::vector<int> seq = a;
  for (auto& t : g["choices"][0]["token_ids"]) seq.push_back(t.get<int>());
  json sc =
      json::parse(cli.Post("/v1/completions",
                           json{{"prompt", seq}, {"max_tokens", 0}, {"prompt_logprobs", 0}}.dump(),
                           "application/json")
                      ->body);
  const json& pl = sc["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(pl.size(), seq.size()) << sc.dump().substr(0, 300);
  EXPECT_TRUE(pl[0].is_null());
  for (size_t i = 0; i < 6; ++i)
    EXPECT_EQ(pl[a.size() + i][std::to_string(seq[a.size() + i])]["logprob"],
              lp["token_logprobs"][i])
        << i;
}

// slime's multi-turn rollout: each turn sends the whole conversation with routed_experts_start_len
// = the rows it already holds, decodes SGLang's format and appends; the joined rows equal the
// solo run of the final conversation (the shared prefix comes from the prefix cache's routes).
TEST(ServerRoutes, MultiTurnWithRoutedExpertsStartLen) {
  const std::string model = test_model("qwen3_moe", "small");
  const ModelConfig c = load_config(model + "/config.json");
  Running s(server_engine_config(model));
  auto cli = s.client();
  std::vector<int> tokens = prompt_of(20, 9);
  std::vector<int16_t> held;  // rows [0, held_rows) of MoE layers, as slime keeps them
  int held_rows = 0;
  for (int turn = 0; turn < 3; ++turn) {
    json r = json::parse(
        cli.Post("/generate",
                 json{{"input_ids", tokens},
                      {"sampling_params",
                       {{"max_new_tokens", 6}, {"temperature", 0.0}, {"ignore_eos", true}}},
                      {"return_routed_experts", true},
                      {"routed_experts_start_len", held_rows}}
                     .dump(),
                 "application/json")
            ->body);
    EXPECT_EQ(r["meta_info"]["routed_experts_start_len"], held_rows);
    if (turn > 0) {
      EXPECT_GT(r["meta_info"]["cached_tokens"].get<int>(), 0);
    }
    const RouteArray part =
        decode_sglang_routes(r["meta_info"]["routed_experts"].get<std::string>(), c.num_layers,
                             c.top_k, c.moe_layers(), held_rows);
    for (auto& t : r["output_ids"]) tokens.push_back(t.get<int>());
    ASSERT_EQ(part.rows, int(tokens.size()) - 1 - held_rows);
    held.insert(held.end(), part.data.begin(), part.data.end());
    held_rows = int(tokens.size()) - 1;
    for (int k = 0; k < 5; ++k)
      tokens.push_back(3 + (turn * 31 + k * 7) % 400);  // the next user turn
  }
  tokens.resize(size_t(held_rows) + 1);  // the conversation the routes cover
  Engine solo(testing::solo_config(model));
  SamplingParams p = testing::greedy(1);
  const RequestOutput want = solo.generate({tokens}, {p})[0];
  ASSERT_GE(want.routed_experts->rows, held_rows);
  const size_t row = size_t(want.routed_experts->layers * want.routed_experts->k);
  ASSERT_EQ(held.size(), size_t(held_rows) * row);
  for (int r = 0; r < held_rows; ++r)
    for (size_t j = 0; j < row; ++j)
      ASSERT_EQ(held[size_t(r) * row + j], want.routed_experts->row(r)[j]) << "row " << r;
}

// Refit over HTTP: the version goes up and replies equal a solo run on the new weights.
TEST(ServerRefit, UpdateWeightsFromDisk) {
  const std::string m0 = test_model("olmoe"), m1 = test_model("olmoe", "tiny", 1);
  Running s(server_engine_config(m0));
  auto cli = s.client();
  const std::vector<int> prompt = prompt_of(30, 14);
  json req = {{"input_ids", prompt},
              {"sampling_params", {{"max_new_tokens", 8}, {"seed", 3}}},
              {"return_routed_experts", true}};
  auto r0 = cli.Post("/generate", req.dump(), "application/json");
  ASSERT_TRUE(r0);
  ASSERT_EQ(r0->status, 200);

  auto u = cli.Post("/update_weights", json{{"model_path", m1}, {"flush_cache", true}}.dump(),
                    "application/json");
  ASSERT_TRUE(u);
  ASSERT_EQ(u->status, 200) << u->body;
  EXPECT_EQ(json::parse(u->body)["weight_version"], "1");  // the counter, without a label
  EXPECT_EQ(json::parse(u->body)["success"], true);

  auto r1 = cli.Post("/generate", req.dump(), "application/json");
  ASSERT_TRUE(r1);
  ASSERT_EQ(r1->status, 200);
  json j1 = json::parse(r1->body);
  EXPECT_EQ(j1["meta_info"]["weight_version"], "1");
  SamplingParams p;
  p.max_tokens = 8;
  p.seed = 3;
  p.return_routed_experts = true;
  Engine solo1(testing::solo_config(m1));
  expect_matches_solo(from_generate(j1, prompt), solo1.generate({prompt}, {p})[0], false, p,
                      "after refit");

  // A checkpoint of another architecture is refused and the old weights keep serving.
  auto bad = cli.Post("/update_weights_from_disk",
                      json{{"model_path", test_model("mixtral")}}.dump(), "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  auto r2 = cli.Post("/generate", req.dump(), "application/json");
  ASSERT_TRUE(r2);
  EXPECT_EQ(json::parse(r2->body)["output_ids"], j1["output_ids"]);

  auto metrics = cli.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("r3_weight_version 1\n"), std::string::npos);
}

}  // namespace
}  // namespace r3

namespace r3 {
namespace {

// Issue 48: a weight body whose safetensors header names a tensor the model lacks, or a wrong
// shape, is refused (SGLang's {"success": false}) as soon as the header has arrived: the 100 MB
// it declares are never read, and the connection is closed after the reply.
TEST(ServerRefit, TensorBodiesAreCheckedBeforeTheirDataArrives) {
  Running s(server_engine_config(test_model("olmoe")), server::ServerOptions{});
  auto reply_to = [&](const std::string& header_json) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(s.port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    std::string body(8, '\0');
    for (int i = 0; i < 8; ++i)
      body[size_t(i)] = char((uint64_t(header_json.size()) >> (8 * i)) & 0xff);
    body += header_json + std::string(20000, '\x01');  // the start of the data, far from all of it
    const std::string head =
        "POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/octet-stream\r\nContent-Length: 100000000\r\n\r\n";
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), ssize_t(head.size()));
    EXPECT_EQ(send(fd, body.data(), body.size(), MSG_NOSIGNAL), ssize_t(body.size()));
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    std::string got;
    char buf[4096];
    for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;)
      got.append(buf, size_t(n));  // until the server closes
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
    close(fd);
    return got;
  };
  std::string got =
      reply_to(R"({"model.nope.weight": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})");
  EXPECT_EQ(got.rfind("HTTP/1.1 400", 0), 0u) << got;
  EXPECT_NE(got.find("\"success\":false"), std::string::npos) << got;
  EXPECT_NE(got.find("model.nope.weight"), std::string::npos) << got;
  got =
      reply_to(R"({"model.norm.weight": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}})");
  EXPECT_EQ(got.rfind("HTTP/1.1 400", 0), 0u) << got;
  EXPECT_NE(got.find("the served model's is"), std::string::npos) << got;
  // The server still serves, at the old weights.
  httplib::Client cli = s.client();
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

}  // namespace
}  // namespace r3
