// Text through r3 serve: text prompts on /v1/completions and /generate, stop strings with the
// peers' names (vLLM's include_stop_str_in_output, SGLang's no_stop_trim), "text" in every
// reply, streamed text deltas that concatenate to the non-streamed text, the matched stop string
// in stop_reason / meta_info.finish_reason, token texts in logprobs, and /tokenize and
// /detokenize with vLLM's fields.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/server.h"
#include "test_tokenizer.h"
#include "text/tokenizer.h"

namespace r3 {
namespace {

using json = nlohmann::json;

struct TextServer {
  std::unique_ptr<server::Server> srv;
  std::shared_ptr<text::Tokenizer> tok;
  int port = 0;
  explicit TextServer(bool trust_request_chat_template = true) {
    EngineConfig c;
    c.model = testing::model_with_tokenizer();
    c.num_kv_blocks = 128;
    c.max_num_seqs = 8;
    c.max_num_batched_tokens = 64;
    c.threads = 1;
    c.enable_return_routed_experts = true;
    server::ServerOptions o;
    o.port = 0;
    o.trust_request_chat_template = trust_request_chat_template;
    srv = std::make_unique<server::Server>(c, o);
    port = srv->start();
    tok = text::Tokenizer::load(c.model);
  }
  json post(const std::string& path, const json& body, int want = 200) const {
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(60, 0);
    auto res = cli.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return {};
    EXPECT_EQ(res->status, want) << path << " " << body.dump() << " -> " << res->body;
    if (res->body.rfind("data: ", 0) == 0) return res->body;
    return json::parse(res->body);
  }
};

// The JSON events of an SSE body (keep-alives and [DONE] left out).
std::vector<json> sse_events(const std::string& body) {
  std::vector<json> out;
  for (size_t pos = 0; pos < body.size();) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    if (ev.rfind("data: ", 0) == 0 && ev != "data: [DONE]")
      out.push_back(json::parse(ev.substr(6)));
  }
  return out;
}

std::string streamed_text(const std::string& body, json* last_choice) {
  std::string text;
  for (const json& j : sse_events(body))
    for (const json& c : j["choices"]) {
      text += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) *last_choice = c;
    }
  return text;
}

TEST(ServerText, TextPromptsStopStringsAndStreamsAgree) {
  TextServer s;
  std::mt19937_64 rng(5);
  int stopped = 0;
  for (int trial = 0; trial < 12; ++trial) {
    SCOPED_TRACE(trial);
    const std::string prompt = "the rain and the " + std::to_string(trial);
    json body = {{"prompt", prompt},
                 {"max_tokens", 20},
                 {"temperature", 1.0},
                 {"seed", trial},
                 {"ignore_eos", true}};
    const json full = s.post("/v1/completions", body);
    const json& c0 = full["choices"][0];
    const std::string text = c0["text"];
    EXPECT_EQ(text, s.tok->decode(c0["token_ids"].get<std::vector<int32_t>>(), true, false));
    // A stop string cut from the middle of the text (bytes of whole characters).
    std::string stop;
    for (size_t b = text.size() / 3; b < text.size(); ++b) {
      if ((static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) continue;
      size_t e = b + 1 + rng() % 4;
      while (e < text.size() && (static_cast<unsigned char>(text[e]) & 0xC0) == 0x80) ++e;
      if (e <= text.size()) stop = text.substr(b, e - b);
      break;
    }
    if (stop.empty()) continue;
    body["stop"] = stop;
    const json cut = s.post("/v1/completions", body);
    const json& c1 = cut["choices"][0];
    EXPECT_EQ(c1["finish_reason"], "stop");
    EXPECT_EQ(c1["stop_reason"], stop);
    EXPECT_EQ(c1["text"], text.substr(0, text.find(stop)));
    // Streamed: the deltas concatenate to the same text.
    body["stream"] = true;
    json last;
    EXPECT_EQ(streamed_text(s.post("/v1/completions", body).get<std::string>(), &last),
              c1["text"].get<std::string>());
    EXPECT_EQ(last["stop_reason"], stop);
    // SGLang: no_stop_trim keeps the stop string; matched names it.
    const json g = s.post("/generate", {{"text", prompt},
                                        {"sampling_params",
                                         {{"max_new_tokens", 20},
                                          {"temperature", 1.0},
                                          {"seed", trial},
                                          {"ignore_eos", true},
                                          {"stop", json::array({stop})},
                                          {"no_stop_trim", true}}}});
    EXPECT_EQ(g["text"], text.substr(0, text.find(stop) + stop.size()));
    EXPECT_EQ(g["meta_info"]["finish_reason"]["matched"], stop);
    ++stopped;
  }
  EXPECT_GE(stopped, 8);
}

TEST(ServerText, TokenizeDetokenizeAndTokenTexts) {
  TextServer s;
  const json t =
      s.post("/tokenize", {{"prompt", "the sand<|im_end|>"}, {"return_token_strs", true}});
  const std::vector<int32_t> ids = s.tok->encode("the sand<|im_end|>", true);
  EXPECT_EQ(t["tokens"].get<std::vector<int32_t>>(), ids);
  EXPECT_EQ(t["count"], ids.size());
  EXPECT_EQ(t["max_model_len"], 4096);
  EXPECT_EQ(t["token_strs"].back(), "<|im_end|>");
  EXPECT_EQ(s.post("/detokenize", {{"tokens", ids}})["prompt"], "the sand<|im_end|>");
  EXPECT_EQ(s.post("/detokenize", {{"tokens", {100000}}}, 400)["error"]["param"], "tokens");
  EXPECT_EQ(s.post("/tokenize", {{"prompt", 5}}, 400)["error"]["param"], "prompt");
  // Token texts in logprobs: vLLM's tokens and SGLang's triples.
  const json c =
      s.post("/v1/completions",
             {{"prompt", "the"}, {"max_tokens", 4}, {"logprobs", 2}, {"ignore_eos", true}});
  const json& lp = c["choices"][0]["logprobs"];
  std::string joined;
  for (const json& x : lp["tokens"]) joined += x.get<std::string>();
  const std::vector<int32_t> out = c["choices"][0]["token_ids"];
  for (size_t i = 0; i < out.size(); ++i)
    EXPECT_EQ(lp["tokens"][i], s.tok->decode(std::vector<int32_t>{out[i]}, false, false));
  const json g =
      s.post("/generate", {{"input_ids", {5, 6}},
                           {"return_text_in_logprobs", true},
                           {"sampling_params", {{"max_new_tokens", 3}, {"ignore_eos", true}}}});
  for (const json& tr : g["meta_info"]["output_token_logprobs"])
    EXPECT_EQ(tr[2], s.tok->decode(std::vector<int32_t>{tr[1].get<int32_t>()}, false, false));
  // Both prompt forms at once is refused by name.
  EXPECT_EQ(s.post("/generate", {{"input_ids", {5}}, {"text", "x"}}, 400)["error"]["param"],
            "text");
}

std::string streamed_chat(const std::string& body, json* last_choice, bool* role_first) {
  std::string text;
  bool first = true;
  for (const json& j : sse_events(body)) {
    EXPECT_EQ(j["object"], "chat.completion.chunk");
    for (const json& c : j["choices"]) {
      if (first) *role_first = c["delta"].value("role", "") == "assistant";
      first = false;
      if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
      if (!c["finish_reason"].is_null()) *last_choice = c;
    }
  }
  return text;
}

TEST(ServerText, ChatCompletionsRenderTheTemplateAndStreamTheSameText) {
  TextServer s;
  const json messages = {{{"role", "system"}, {"content", "be brief"}},
                         {{"role", "user"}, {"content", "the sand and"}}};
  json body = {{"messages", messages},
               {"max_tokens", 16},
               {"temperature", 1.0},
               {"seed", 3},
               {"ignore_eos", true},
               {"logprobs", true},
               {"top_logprobs", 2},
               {"return_routed_experts", true},
               {"n", 2}};
  const json r = s.post("/v1/chat/completions", body);
  EXPECT_EQ(r["object"], "chat.completion");
  const std::string prompt =
      "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe sand and<|im_end|>\n"
      "<|im_start|>assistant\n";
  EXPECT_EQ(r["prompt_token_ids"].get<std::vector<int32_t>>(), s.tok->encode(prompt, false));
  ASSERT_EQ(r["choices"].size(), 2u);
  for (const json& c : r["choices"]) {
    EXPECT_EQ(c["message"]["role"], "assistant");
    EXPECT_EQ(c["message"]["content"],
              s.tok->decode(c["token_ids"].get<std::vector<int32_t>>(), true, false));
    EXPECT_EQ(c["logprobs"]["content"].size(), c["token_ids"].size());
    EXPECT_EQ(c["logprobs"]["content"][0]["top_logprobs"].size(), 2u);
    EXPECT_TRUE(c.contains("routed_experts")) << c.dump();
  }
  // Streamed with a stop string: role first, deltas concatenating to the non-streamed content.
  const std::string full = r["choices"][0]["message"]["content"];
  body["n"] = 1;
  body.erase("logprobs");
  body.erase("top_logprobs");
  if (full.size() > 6) body["stop"] = full.substr(full.size() / 2, 2);
  const json once = s.post("/v1/chat/completions", body);
  body["stream"] = true;
  json last;
  bool role_first = false;
  EXPECT_EQ(
      streamed_chat(s.post("/v1/chat/completions", body).get<std::string>(), &last, &role_first),
      once["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_TRUE(role_first);
  EXPECT_EQ(last["finish_reason"], once["choices"][0]["finish_reason"]);
  // A template given per request, with chat_template_kwargs.
  const json k = s.post(
      "/v1/chat/completions",
      {{"messages", messages},
       {"max_tokens", 1},
       {"chat_template", "{{ messages[-1]['content'] }}{% if enable_thinking %}!{% endif %}"},
       {"chat_template_kwargs", {{"enable_thinking", true}}}});
  EXPECT_EQ(k["prompt_token_ids"].get<std::vector<int32_t>>(),
            s.tok->encode("the sand and!", false));
  // Refused by name: tool parsing r3 does not do, a template error, no messages.
  EXPECT_EQ(s.post("/v1/chat/completions", {{"messages", messages}, {"tool_choice", "required"}},
                   400)["error"]["param"],
            "tool_choice");
  EXPECT_EQ(s.post("/v1/chat/completions",
                   {{"messages", messages}, {"chat_template", "{{ raise_exception('no') }}"}},
                   400)["error"]["param"],
            "messages");
  EXPECT_EQ(s.post("/v1/chat/completions", {{"messages", json::array()}}, 400)["error"]["param"],
            "messages");
  // Image parts (text only is served), while text parts pass.
  const json image = {
      {{"role", "user"},
       {"content",
        {{{"type", "text"}, {"text", "what is"}},
         {{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,AA=="}}}}}}}};
  const json refused = s.post("/v1/chat/completions", {{"messages", image}}, 400)["error"];
  EXPECT_EQ(refused["param"], "messages");
  EXPECT_NE(refused["message"].get<std::string>().find("\"image_url\""), std::string::npos)
      << refused.dump();
  const json text_parts = {
      {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "the sand"}}}}}};
  s.post("/v1/chat/completions", {{"messages", text_parts},
                                  {"max_tokens", 1},
                                  {"chat_template", "{{ messages[0]['content'][0]['text'] }}"}});
}

TEST(ServerText, RequestTemplatesAreRefusedUnlessTrusted) {
  TextServer s(false);
  const json messages = {{{"role", "user"}, {"content", "the sand and"}}};
  const std::string vllm_words =
      "Chat template is passed with request, but --trust-request-chat-template is not set.";
  for (const json& body :
       {json{{"messages", messages}, {"chat_template", "{{ 'x' }}"}},
        json{{"messages", messages}, {"chat_template_kwargs", {{"chat_template", "{{ 'x' }}"}}}}}) {
    const json e = s.post("/v1/chat/completions", body, 400)["error"];
    EXPECT_NE(e["message"].get<std::string>().find(vllm_words), std::string::npos) << e.dump();
    EXPECT_EQ(e["param"], "chat_template");
  }
  // The model's own template still serves.
  EXPECT_EQ(s.post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 1}})["object"],
            "chat.completion");
}

// Issue 48's reproductions through the server: each hostile request template is a 400 naming the
// template line, within its budget, while completions running beside them stay bit-identical
// to a solo run and the server stays healthy.
TEST(ServerText, HostileTemplatesAre400sAndTheServerKeepsServing) {
  TextServer s;
  const json solo_body = {{"prompt", "the sand and"},
                          {"max_tokens", 8},
                          {"temperature", 1.0},
                          {"seed", 11},
                          {"ignore_eos", true}};
  const json solo = s.post("/v1/completions", solo_body)["choices"][0]["token_ids"];
  std::atomic<bool> done{false};
  std::atomic<int> checked{0}, mismatched{0};
  std::thread background([&] {
    while (!done) {
      const json r = s.post("/v1/completions", solo_body);
      ++checked;
      if (r["choices"][0]["token_ids"] != solo) ++mismatched;
    }
  });
  const std::string deep(100000, '(');
  const std::vector<std::string> hostile = {
      "{% for i in range(10**9) %}{% endfor %}",
      "{{ 'a' * 10**10 }}",
      "{{ 'a\nb' | indent(10**9) }}",
      "{{ [[1]] | tojson(indent=10**8) }}",
      "{% macro f(g) %}{{ g(g) }}{% endmacro %}{{ f(f) }}",
      "{{ " + deep + "1 }}",
      "{{ (-9223372036854775807 - 1) // -1 }}",
      "{% set l = [] %}{{ l.append(l) }}{{ l | tojson }}",
      "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
      "{{ 99999999999999999999 }}",
      "{{ '\\uZZZZ' }}",
  };
  const json messages = {{{"role", "user"}, {"content", "hi"}}};
  for (const std::string& t : hostile) {
    const auto t0 = std::chrono::steady_clock::now();
    const json e = s.post("/v1/chat/completions", {{"messages", messages}, {"chat_template", t}},
                          400)["error"];
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15.0)
        << t.substr(0, 60);
    EXPECT_NE(e["message"].get<std::string>().find("chat template line 1"), std::string::npos)
        << e.dump();
  }
  // A cyclic value printed as Python prints it, and the server still renders good templates.
  EXPECT_EQ(
      s.post("/v1/chat/completions",
             {{"messages", messages},
              {"max_tokens", 1},
              {"chat_template", "{% set l = [1] %}{{ l.append(l) }}{{ l }}"}})["prompt_token_ids"]
          .get<std::vector<int32_t>>(),
      s.tok->encode("None[1, [...]]", false));
  done = true;
  background.join();
  EXPECT_GT(checked.load(), 0);
  EXPECT_EQ(mismatched.load(), 0);
  // A tools list too long for the context by its bytes alone is refused before encoding.
  json tools = json::array();
  for (int i = 0; i < 20000; ++i)
    tools.push_back(
        {{"type", "function"},
         {"function", {{"name", "f" + std::to_string(i)}, {"description", std::string(80, 'd')}}}});
  const auto t0 = std::chrono::steady_clock::now();
  const json big = s.post("/v1/chat/completions",
                          {{"messages", messages},
                           {"tools", tools},
                           {"chat_template", "{{ tools | tojson }}{{ messages[-1]['content'] }}"}},
                          400)["error"];
  EXPECT_NE(big["message"].get<std::string>().find("tokens: more than the"), std::string::npos)
      << big.dump();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  httplib::Client cli("127.0.0.1", s.port);
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

// A client that leaves while its text is being tokenized stops the work: with one HTTP thread,
// the next request is answered at once instead of after the abandoned encode (9 MB of "ing",
// one pre-token of 6M merges: seconds of CPU).
TEST(ServerText, TokenizingStopsWhenItsClientLeaves) {
  EngineConfig c;
  c.model = testing::model_with_tokenizer();
  c.num_kv_blocks = 16;
  c.threads = 1;
  server::ServerOptions o;
  o.port = 0;
  o.http_threads = 1;
  server::Server srv(c, o);
  const int port = srv.start();
  std::string text;
  for (int i = 0; i < 3'000'000; ++i) text += "ing";
  const std::string body = json{{"prompt", text}}.dump();
  const std::string head =
      "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n";
  // What the encode costs when its client stays (the reference the bound below is set against).
  const auto t0 = std::chrono::steady_clock::now();
  const double whole = [&] {
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(120, 0);
    auto res = cli.Post("/tokenize", body, "application/json");
    EXPECT_TRUE(res && res->status == 200);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string request = head + body;
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    ASSERT_GT(n, 0);
    sent += size_t(n);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the encode has begun
  ::close(fd);
  const auto t1 = std::chrono::steady_clock::now();
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120, 0);
  auto res = cli.Post("/tokenize", json{{"prompt", "the sand"}}.dump(), "application/json");
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_LT(after, whole / 2) << "the whole encode took " << whole << " s";
  srv.stop();
}

}  // namespace
}  // namespace r3
