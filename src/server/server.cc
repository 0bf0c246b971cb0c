// The HTTP layer: routing, auth, body limits, error replies, and the waits on the engine loop.
// Request/reply formats live in openai_api.cc and generate_api.cc; metrics in metrics.cc.
#include "server/server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <random>
#include <semaphore>
#include <thread>

#include "core/cancellation.h"
#include "core/error.h"
#include "model/config_json.h"
#include "server/api_error.h"
#include "server/chat_api.h"
#include "server/gated_http_server.h"
#include "server/generate_api.h"
#include "server/json_fields.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/serving_names.h"
#include "server/tokenize_api.h"
#include "text/jinja_budget.h"

namespace r3::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::string dumps(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dumps(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status(), error_body(e));
  if (e.status() == 401) res.set_header("WWW-Authenticate", "Bearer");
}

bool equal_const_time(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

std::string sse(const json& j) { return "data: " + dumps(j) + "\n\n"; }

const char* status_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

// What every streamed call shares: its channel, the SSE writes, the keep-alive comment that
// finds a vanished client, and the closing "data: [DONE]".
struct SseStream {
  EngineLoop* loop = nullptr;
  std::shared_ptr<Channel> ch;
  std::vector<uint64_t> ids;
  uint64_t seen = 0;
  bool closed = false;  // "data: [DONE]" written
  Clock::time_point last_write = Clock::now();

  bool write(httplib::DataSink& sink, const std::string& s) {
    if (!sink.write(s.data(), s.size())) return false;
    last_write = Clock::now();
    return true;
  }
  bool close_with(httplib::DataSink& sink, std::string out) {
    out += "data: [DONE]\n\n";
    if (!write(sink, out)) return false;
    closed = true;
    sink.done();
    return true;
  }
  // The outputs published since the last call, or false when none came within 200 ms (then an
  // SSE comment goes out once a second; *alive says whether it could be written).
  bool take(httplib::DataSink& sink, std::vector<std::optional<RequestOutput>>& outs, bool* alive) {
    *alive = true;
    if (ch->take(seen, std::chrono::milliseconds(200), outs)) return true;
    if (Clock::now() - last_write >= std::chrono::seconds(1))
      *alive = write(sink, ": keep-alive\n\n");
    return false;
  }
  // A chunk's route rows: those of r past what earlier chunks sent (absolute positions before
  // *sent_end), which moves to r's end, so each row goes out once.
  static RouteArray rows_not_sent(const RouteArray& r, int* sent_end) {
    const int end = r.start + r.rows;
    RouteArray out = route_rows(r, *sent_end, end);
    *sent_end = std::max(*sent_end, end);
    return out;
  }
  // The failure that ends a stream (an error chunk, then [DONE]) for an output, or "".
  static std::string failure_of(const RequestOutput& o, size_t i, std::string* type) {
    *type = o.error.empty() ? "routes_error" : "model_error";
    if (!o.finished) return "";
    if (!o.error.empty()) return "choice " + std::to_string(i) + ": " + o.error;
    if (!o.routes_error.empty())
      return "choice " + std::to_string(i) + ": routes are incomplete (" + o.routes_error +
             "); the request fails closed";
    return "";
  }
};

// A streamed /v1/completions or chat call: what was sent so far.
struct CompletionStream : SseStream {
  CompletionRequest req;
  std::string id, model;
  int64_t created = 0;
  std::vector<size_t> sent, sent_text;  // tokens and text bytes streamed, per choice
  std::vector<int> rows_sent;  // route rows streamed: absolute positions before this, per choice
  std::vector<bool> started;   // chat: the role delta went out
  std::vector<bool> done;
  size_t num_done = 0;

  json chunk(json choices) const {
    return {{"id", id},
            {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created},
            {"model", model},
            {"choices", std::move(choices)}};
  }

  // One call of the chunked content provider. False: the client is gone (or the write failed).
  bool step(httplib::DataSink& sink) {
    std::vector<std::optional<RequestOutput>> outs;
    bool alive = true;
    if (!take(sink, outs, &alive)) return alive;
    if (std::string f = ch->failure(); !f.empty())
      return close_with(sink, sse(error_body(f, "server_error", "", 503)));
    std::string out;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!outs[i] || done[i]) continue;
      RequestOutput& o = *outs[i];
      std::string type;
      if (std::string why = failure_of(o, i, &type); !why.empty()) {
        loop->abort(ids);
        return close_with(sink, out + sse(error_body(why, type.c_str(), "", 500)));
      }
      // A chunk's route rows are those past what earlier chunks sent: the rows that came with
      // its tokens (and the prompt's with the first), or the rest of a finished output's.
      if (o.routed_experts) o.routed_experts = rows_not_sent(*o.routed_experts, &rows_sent[i]);
      const bool new_rows = o.routed_experts && o.routed_experts->rows > 0;
      if (o.token_ids.size() <= sent[i] && o.text.size() <= sent_text[i] && !o.finished &&
          !new_rows)
        continue;
      json choice = req.chat ? chat_chunk_choice(o, i, sent[i], sent_text[i], !started[i], req)
                             : completion_chunk_choice(o, i, sent[i], sent_text[i], req);
      started[i] = true;
      out += sse(chunk(json::array({std::move(choice)})));
      sent[i] = o.token_ids.size();
      sent_text[i] = o.text.size();
      if (o.finished) {
        done[i] = true;
        ++num_done;
      }
    }
    if (!out.empty() && !write(sink, out)) return false;
    if (num_done < done.size()) return true;
    json last = chunk(json::array());
    last["usage"] = completion_usage(req, sent);
    return close_with(sink, sse(last));
  }
};

// A streamed /generate call, as SGLang streams it: each chunk is the reply so far (text and
// output_ids cumulative, finish_reason null until the end), the last one the whole reply, routes
// included, then "data: [DONE]". Incremental (--incremental-streaming-output), each chunk holds
// only what is new: text, output_ids, output_token_logprobs, weight_versions and route rows
// (meta_info.routed_experts_start_len their first row), so chunks concatenate to the reply.
struct GenerateStream : SseStream {
  GenerateRequest req;
  std::string rid;
  std::function<std::string()> weight_label;
  bool incremental = false;
  size_t sent = 0, sent_text = 0;  // tokens and text bytes sent
  int rows_sent = 0;               // route rows sent: absolute positions before this

  // What is new in o since the last chunk, as an output generate_reply can write (the prompt's
  // logprobs with the first chunk only).
  RequestOutput delta(const RequestOutput& o) {
    RequestOutput d;
    auto tail = [&](const auto& v) {
      return std::decay_t<decltype(v)>(v.begin() + long(std::min(sent, v.size())), v.end());
    };
    d.token_ids = tail(o.token_ids);
    d.logprobs = tail(o.logprobs);
    d.top_logprobs = tail(o.top_logprobs);
    d.weight_versions = tail(o.weight_versions);
    d.text = o.text.substr(std::min(sent_text, o.text.size()));
    d.num_cached_tokens = o.num_cached_tokens;
    if (sent == 0 && sent_text == 0) {
      d.prompt_logprobs_start = o.prompt_logprobs_start;
      d.prompt_logprobs = o.prompt_logprobs;
      d.prompt_top_logprobs = o.prompt_top_logprobs;
      d.prompt_token_ids = o.prompt_token_ids;
    }
    if (o.routed_experts) d.routed_experts = rows_not_sent(*o.routed_experts, &rows_sent);
    return d;
  }

  bool step(httplib::DataSink& sink) {
    std::vector<std::optional<RequestOutput>> outs;
    bool alive = true;
    if (!take(sink, outs, &alive)) return alive;
    if (std::string f = ch->failure(); !f.empty())
      return close_with(sink, sse(error_body(f, "server_error", "", 503)));
    if (!outs[0]) return true;
    RequestOutput& o = *outs[0];
    std::string type;
    if (std::string why = failure_of(o, 0, &type); !why.empty()) {
      loop->abort(ids);
      return close_with(sink, sse(error_body(why, type.c_str(), "", 500)));
    }
    if (!o.finished && o.token_ids.size() <= sent) return true;
    json reply;
    if (incremental) {
      reply = generate_reply(delta(o), rid, req, weight_label());
      json& meta = reply["meta_info"];
      meta["prompt_tokens"] = o.prompt_token_ids.size();  // counts stay whole, as SGLang's
      meta["completion_tokens"] = o.token_ids.size();
      meta["finish_reason"] = o.finished ? generate_finish_reason(o) : json(nullptr);
      sent_text = o.text.size();
    } else {
      reply = generate_reply(o, rid, req, weight_label());
      if (!o.finished) reply["meta_info"]["finish_reason"] = nullptr;
    }
    sent = o.token_ids.size();
    return o.finished ? close_with(sink, sse(reply)) : write(sink, sse(reply));
  }
};

// Runs a stream on httplib's chunked content provider: a failed step or a client gone before
// [DONE] aborts the call's requests.
template <class Stream>
void serve_stream(httplib::Response& res, std::shared_ptr<Stream> st, const std::string& id) {
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [st, id](size_t, httplib::DataSink& sink) {
        bool ok = false;
        try {
          ok = st->step(sink);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "r3 serve: stream %s: %s\n", id.c_str(), e.what());
        }
        if (!ok) st->loop->abort(st->ids);
        return ok;
      },
      [st](bool) {
        if (!st->closed) st->loop->abort(st->ids);  // the client went away mid-stream
      });
}

}  // namespace

struct Server::Impl {
  ServerOptions opts;
  EngineConfig engine_cfg;
  std::unique_ptr<EngineLoop> loop;
  // control: /health, /metrics, /abort (ServerOptions::control_port). Both hold connections in a
  // gate until a whole request has arrived (gated_http_server.h).
  GatedHttpServer http, control;
  std::vector<ServedEndpoint> served;  // filled by routes() before either listener starts
  std::thread bg, control_bg;
  int port = -1, control_port = -1;
  socket_t listen_fd = -1, control_fd = -1;
  std::atomic<bool> stopped{false}, draining{false};
  // Chat templates render on at most this many HTTP threads at once (the machine's cores): a
  // render is CPU work within its budget, so more at once would only multiply the memory that
  // hostile templates can hold; the others wait, at most one render's time budget.
  std::counting_semaphore<> render_slots{
      std::max<std::ptrdiff_t>(1, std::thread::hardware_concurrency())};
  std::mutex stop_mu;
  std::mutex health_mu;              // /health_generate: one generation at a time
  Clock::time_point health_ok_at{};  // its last success
  int64_t started = int64_t(std::time(nullptr));
  std::atomic<uint64_t> next_id{0};
  std::mutex rng_mu;
  std::mt19937_64 rng{std::random_device{}()};
  std::mutex counters_mu;
  HttpCounters counters;

  uint64_t fresh_seed() {
    std::lock_guard<std::mutex> lk(rng_mu);
    return rng();
  }
  std::string fresh_id(const char* prefix) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s-%llx%04llx", prefix,
                  (unsigned long long)next_id.fetch_add(1),
                  (unsigned long long)(fresh_seed() & 0xffff));
    return buf;
  }

  bool authorized(const httplib::Request& req) const {
    if (opts.api_key.empty()) return true;
    return equal_const_time(req.get_header_value("Authorization"), "Bearer " + opts.api_key);
  }

  // Whether the request this HTTP thread handles no longer matters: its client left, or the
  // server is stopping. Long work on the thread (tokenizing, template renders) polls it through
  // the CancellationScope every handler runs in.
  bool request_cancelled() const { return stopped || draining || GatedHttpServer::client_gone(); }

  // Handler wrapper: API key, and every exception becomes a JSON error reply.
  httplib::Server::Handler wrap(
      bool auth, std::function<void(const httplib::Request&, httplib::Response&)> fn) {
    return [this, auth, fn](const httplib::Request& req, httplib::Response& res) {
      try {
        if (auth && !authorized(req))
          throw ApiError(401, "missing or wrong API key: send \"Authorization: Bearer KEY\"",
                         "authentication_error");
        CancellationScope cancel([this] { return request_cancelled(); });
        fn(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const ServingError& e) {
        send_error(res, api_error_of(e));
      } catch (const Error& e) {
        send_error(res, bad_request(e.what()));
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, std::string("internal error: ") + e.what(), "server_error"));
      }
    };
  }

  RouteReply route_reply(std::optional<RouteFormat> asked, RouteFormat endpoint_default) const {
    RouteFormat f = endpoint_default;
    if (asked)
      f = *asked;
    else if (!opts.routed_experts_format.empty())
      f = parse_route_format(opts.routed_experts_format);
    return {f, loop->model_config().num_layers};
  }

  // The connection ends with this reply (a body left unread would be taken for the next request).
  static void close_after_reply(httplib::Response& res) {
    res.set_header("Connection", "close");
    GatedHttpServer::close_after_reply();
  }

  [[noreturn]] void throw_too_large(size_t cap) const {
    throw ApiError(
        413,
        "request body is larger than " + std::to_string(cap) + " bytes (" +
            (cap == opts.max_body_bytes ? "--max-body-bytes" : "--max-weights-body-bytes") + ")",
        "request_too_large");
  }

  // A POST endpoint: the API key is checked before a byte of the body is read, and the body is
  // read here, capped at --max-body-bytes whatever its transfer encoding (chunked bodies carry
  // no length to check up front) and within a time limit, so a slow sender cannot hold a
  // connection slot indefinitely.
  // `body_start.check`, when given, sees the body as it arrives and returns true once it has
  // checked what it needs; it throws r3::Error to refuse the request before the rest is read,
  // and body_start.refuse writes that reply. The handler may take the body (its only copy).
  struct BodyStart {
    std::function<bool(std::string_view)> check;
    std::function<void(httplib::Response&, const std::string&)> refuse;
  };
  httplib::Server::HandlerWithContentReader post(
      std::function<void(httplib::Request&, httplib::Response&)> fn, bool auth, size_t cap,
      BodyStart body_start = {}) {
    return [this, fn, auth, cap, body_start](const httplib::Request& req, httplib::Response& res,
                                             const httplib::ContentReader& reader) {
      try {
        if (auth && !authorized(req))
          throw ApiError(401, "missing or wrong API key: send \"Authorization: Bearer KEY\"",
                         "authentication_error");
        const size_t declared =
            size_t(std::strtoull(req.get_header_value("Content-Length").c_str(), nullptr, 10));
        if (declared > cap) throw_too_large(cap);
        std::string body;
        body.reserve(declared);  // one allocation of the declared size, not a doubling series
        bool too_large = false, too_slow = false, started = !body_start.check;
        std::optional<Error> refused;
        const auto deadline = Clock::now() + std::chrono::seconds(opts.body_timeout_seconds);
        const bool read_all = reader([&](const char* data, size_t len) {
          if (body.size() + len > cap) return !(too_large = true);
          if (Clock::now() > deadline) return !(too_slow = true);
          body.append(data, len);
          if (!started) {
            try {
              started = body_start.check(body);
            } catch (const Error& e) {
              refused = e;
              return false;
            }
          }
          return true;
        });
        if (too_large) throw_too_large(cap);
        if (refused) {
          body_start.refuse(res, refused->what());
          close_after_reply(res);  // the unread rest of the body is not drained
          return;
        }
        if (too_slow)
          throw ApiError(408,
                         "request body took longer than " +
                             std::to_string(opts.body_timeout_seconds) + " s to arrive",
                         "invalid_request_error");
        if (!read_all)
          throw ApiError(400,
                         "the request body could not be read (connection closed or malformed)");
        httplib::Request full = req;
        full.body = std::move(body);
        CancellationScope cancel([this] { return request_cancelled(); });
        fn(full, res);
      } catch (const ApiError& e) {
        send_error(res, e);
        if (e.status() == 413 || e.status() == 408) close_after_reply(res);
      } catch (const ServingError& e) {
        send_error(res, api_error_of(e));
      } catch (const Error& e) {
        send_error(res, bad_request(e.what()));
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, std::string("internal error: ") + e.what(), "server_error"));
      }
    };
  }

  // Submits jobs; an engine refusal becomes a 400 naming the request field.
  std::vector<uint64_t> submit(std::vector<Job> jobs, std::shared_ptr<Channel> ch,
                               const std::string& rid, FrontEnd api, size_t per_prompt) {
    const size_t n = jobs.size();
    try {
      return loop->submit(std::move(jobs), std::move(ch), rid);
    } catch (const SubmitError& e) {
      std::string msg = e.what();
      if (n > per_prompt)
        msg =
            param_of_field("prompt", api) + " " + std::to_string(e.index / per_prompt) + ": " + msg;
      throw bad_request(msg, param_of_field(e.field, api));
    }
  }

  // Waits for every choice of a non-streamed call.
  std::vector<RequestOutput> wait_all(Channel& ch) {
    std::vector<std::optional<RequestOutput>> got(ch.size()), outs;
    uint64_t seen = 0;
    size_t have = 0;
    while (have < got.size()) {
      if (std::string f = ch.failure(); !f.empty()) throw ApiError(503, f, "server_error");
      if (!ch.take(seen, std::chrono::seconds(1), outs)) continue;
      for (size_t i = 0; i < outs.size(); ++i)
        if (outs[i] && !got[i]) {
          got[i] = std::move(outs[i]);
          ++have;
        }
    }
    std::vector<RequestOutput> r;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!got[i]->error.empty())
        throw ApiError(500, "request " + std::to_string(i) + ": " + got[i]->error, "model_error");
      if (!got[i]->routes_error.empty())
        throw ApiError(500,
                       "request " + std::to_string(i) + ": routes are incomplete (" +
                           got[i]->routes_error + "); the request fails closed",
                       "routes_error");
      r.push_back(std::move(*got[i]));
    }
    return r;
  }

  void completions(const httplib::Request& hreq, httplib::Response& res, bool chat) {
    json body = parse_body(hreq.body);
    auto st = std::make_shared<CompletionStream>();
    if (chat) {
      const EngineConfig& ec = loop->engine_config();
      const int max_context =
          std::min(loop->model_config().max_position_embeddings, ec.num_kv_blocks * ec.block_size);
      ChatTemplatePolicy policy;
      policy.trust_request_chat_template = opts.trust_request_chat_template;
      policy.cancelled = [this] { return request_cancelled(); };
      if (!render_slots.try_acquire_for(
              std::chrono::duration<double>(text::jinja::RenderLimits{}.max_seconds)))
        throw ApiError(503, "every chat-template render slot stayed busy; retry", "server_error");
      struct Release {
        std::counting_semaphore<>& s;
        ~Release() { s.release(); }
      } release{render_slots};
      st->req = parse_chat_request(
          body, hreq.body, [this] { return fresh_seed(); }, loop->tokenizer(), max_context, policy);
    } else {
      st->req = parse_completion_request(
          body, [this] { return fresh_seed(); }, loop->tokenizer().get());
    }
    st->req.routes = route_reply(st->req.routes_format, RouteFormat::Vllm);
    st->id = st->req.request_id ? *st->req.request_id : fresh_id(chat ? "chatcmpl" : "cmpl");
    st->model = opts.model_name;
    st->created = int64_t(std::time(nullptr));
    st->loop = loop.get();
    const size_t choices = st->req.jobs.size();
    st->ch = std::make_shared<Channel>(choices, st->req.stream);
    if (st->req.stream)  // each chunk carries its tokens' route rows (when it asked for routes)
      for (Job& j : st->req.jobs) j.params.stream_routes = true;
    const std::vector<int> prompt_ids =
        chat && !st->req.jobs.empty() ? st->req.jobs[0].prompt : std::vector<int>{};
    st->ids = submit(std::move(st->req.jobs), st->ch, st->id,
                     chat ? FrontEnd::Chat : FrontEnd::Completions, st->req.n);
    if (!st->req.stream) {
      std::vector<RequestOutput> outs = wait_all(*st->ch);
      json cs = json::array();
      std::vector<size_t> ntok;
      for (size_t i = 0; i < outs.size(); ++i) {
        cs.push_back(chat ? chat_choice(outs[i], i, st->req)
                          : completion_choice(outs[i], i, st->req));
        ntok.push_back(outs[i].token_ids.size());
      }
      json reply = {
          {"id", st->id},           {"object", chat ? "chat.completion" : "text_completion"},
          {"created", st->created}, {"model", st->model},
          {"choices", cs},          {"usage", completion_usage(st->req, ntok)}};
      if (chat) reply["prompt_token_ids"] = prompt_ids;
      // vLLM puts the prompt's routes at the top level: there when the call has one prompt (each
      // choice also carries its own, so batches keep them apart).
      if (st->req.num_prompts == 1 && !cs.empty() && cs[0].contains("prompt_routed_experts"))
        reply["prompt_routed_experts"] = cs[0]["prompt_routed_experts"];
      send_json(res, 200, reply);
      return;
    }
    st->sent.assign(choices, 0);
    st->sent_text.assign(choices, 0);
    st->rows_sent.assign(choices, 0);
    st->started.assign(choices, false);
    st->done.assign(choices, false);
    serve_stream(res, st, st->id);
  }

  void generate(const httplib::Request& hreq, httplib::Response& res) {
    json body = parse_body(hreq.body);
    GenerateRequest g = parse_generate_request(
        body, [this] { return fresh_seed(); }, loop->tokenizer().get());
    g.routes = route_reply(g.routes_format, RouteFormat::Sglang);
    const std::string rid = g.rid ? *g.rid : fresh_id("gen");
    if (g.stream) {
      auto st = std::make_shared<GenerateStream>();
      st->loop = loop.get();
      st->ch = std::make_shared<Channel>(1, true);
      st->rid = rid;
      st->weight_label = [this] { return loop->weight_label(); };
      st->incremental = opts.incremental_streaming_output;
      if (st->incremental)  // each chunk carries its tokens' route rows (when it asked for routes)
        for (Job& j : g.jobs) j.params.stream_routes = true;
      st->ids = submit(std::move(g.jobs), st->ch, rid, FrontEnd::Generate, 1);
      st->req = std::move(g);
      serve_stream(res, st, rid);
      return;
    }
    auto ch = std::make_shared<Channel>(g.jobs.size(), false);
    submit(std::move(g.jobs), ch, rid, FrontEnd::Generate, 1);
    std::vector<RequestOutput> outs = wait_all(*ch);
    const std::string v = loop->weight_label();
    if (!g.batch) {
      send_json(res, 200, generate_reply(outs[0], rid, g, v));
      return;
    }
    json arr = json::array();
    for (size_t i = 0; i < outs.size(); ++i)
      arr.push_back(generate_reply(outs[i], rid + "-" + std::to_string(i), g, v));
    send_json(res, 200, arr);
  }

  // SGLang's update_weights_from_disk: 200 {"success": true, ...} or 400 {"success": false,
  // "message"}; the old weights keep serving after a failure.
  void update_weights(const httplib::Request& hreq, httplib::Response& res) {
    json body = parse_body(hreq.body);
    refuse_unknown_fields(
        body, "",
        {"model_path", "load_format", "flush_cache", "weight_version", "abort_all_requests",
         "torch_empty_cache", "keep_pause", "is_async", "recapture_cuda_graph", "token_step"});
    auto path = opt_string(body, "model_path", "model_path");
    if (!path || path->empty())
      throw bad_request("missing \"model_path\" (a checkpoint directory)", "model_path");
    if (auto f = opt_string(body, "load_format", "load_format");
        f && *f != "auto" && *f != "safetensors")
      throw bad_request("\"load_format\" \"" + *f + "\" is not supported (r3 reads safetensors)",
                        "load_format");
    if (opt_bool(body, "is_async", "is_async").value_or(false))
      throw bad_request("\"is_async\" is not supported: r3 loads the checkpoint before it replies",
                        "is_async");
    const bool flush = opt_bool(body, "flush_cache", "flush_cache").value_or(true);
    const bool abort_all =
        opt_bool(body, "abort_all_requests", "abort_all_requests").value_or(false);
    std::optional<std::string> label;
    if (body.contains("weight_version") && !body["weight_version"].is_null()) {
      const json& w = body["weight_version"];
      if (!w.is_string() && !w.is_number_integer())
        throw bad_request("\"weight_version\" must be a string", "weight_version");
      label = w.is_string() ? w.get<std::string>() : w.dump();
    }
    try {
      loop->update_weights(*path, flush, label, abort_all);
    } catch (const Error& e) {
      send_json(res, 400, {{"success", false}, {"message", e.what()}, {"num_paused_requests", 0}});
      return;
    }
    const std::string v = loop->weight_label();
    send_json(res, 200,
              {{"success", true},
               {"message", "Succeeded to update model weights from " + *path +
                               (flush ? " (prefix cache flushed)." : ".") +
                               " Weight version updated to " + v + "."},
               {"num_paused_requests", 0},
               {"weight_version", v}});
  }

  // The body is a safetensors file of tensors by Hugging Face name; options come as query
  // parameters (flush_cache, weight_version, finished, abort_all_requests). each bucket is packed
  // as it arrives (Engine::stage_weights); the bucket that says finished ends the refit.
  void update_weights_from_tensor(httplib::Request& hreq, httplib::Response& res) {
    for (auto& [k, v] : hreq.params)
      if (k != "flush_cache" && k != "weight_version" && k != "finished" &&
          k != "abort_all_requests")
        throw bad_request("unknown query parameter \"" + k + "\"", k);
    auto flag = [&](const char* k, bool dflt) {
      if (!hreq.has_param(k)) return dflt;
      const std::string v = hreq.get_param_value(k);
      if (v == "true" || v == "1") return true;
      if (v == "false" || v == "0") return false;
      throw bad_request(std::string("query parameter \"") + k + "\" must be true or false", k);
    };
    const bool flush = flag("flush_cache", true), finished = flag("finished", true);
    const bool abort_all = flag("abort_all_requests", false);
    std::optional<std::string> label;
    if (hreq.has_param("weight_version")) label = hreq.get_param_value("weight_version");
    try {
      auto [n, v] = loop->update_weights_from_tensors(std::move(hreq.body), flush, label, finished,
                                                      abort_all);
      send_json(res, 200,
                {{"success", true},
                 {"message", finished ? "applied " + std::to_string(n) +
                                            " tensors; weight version " + loop->weight_label()
                                      : "staged " + std::to_string(n) +
                                            " tensors; send finished=true to apply"},
                 {"num_tensors", n},
                 {"finished", finished},
                 {"weight_version", loop->weight_label()}});
    } catch (const Error& e) {
      send_json(res, 400, {{"success", false}, {"message", e.what()}});
    }
  }

  void pause_generation(const httplib::Request& hreq, httplib::Response& res) {
    json body = hreq.body.empty() ? json::object() : parse_body(hreq.body);
    refuse_unknown_fields(body, "", {"mode"});
    loop->pause_generation(opt_string(body, "mode", "mode").value_or("abort"));
    send_json(res, 200, {{"message", "Generation paused successfully."}, {"status", "ok"}});
  }

  void continue_generation(const httplib::Request& hreq, httplib::Response& res) {
    json body = hreq.body.empty() ? json::object() : parse_body(hreq.body);
    refuse_unknown_fields(body, "",
                          {"torch_empty_cache"});  // a GPU allocator call: nothing to do on a CPU
    loop->continue_generation();
    send_json(res, 200, {{"message", "Generation continued successfully."}, {"status", "ok"}});
  }

  // Plain text, as SGLang answers: 200 when flushed, 400 while requests run or wait.
  void flush_cache(httplib::Response& res) {
    const bool ok = loop->flush_cache();
    res.status = ok ? 200 : 400;
    res.set_content(ok ? "Cache flushed.\n"
                       : "Cache not flushed: requests are running or waiting (flush_cache needs an "
                         "idle engine).\n",
                    "text/plain");
  }

  // A real one-token generation through the engine loop, answered within a time limit. As in
  // SGLang it needs no API key (probes carry none), so it is rate-limited instead: one
  // generation at a time, and callers within a second of a success share it.
  void health_generate(httplib::Response& res) {
    if (std::string f = loop->failure(); !f.empty())
      throw ApiError(503, "the engine failed: " + f, "server_error");
    if (stopped || draining) throw ApiError(503, "server shutting down", "server_error");
    if (loop->paused())
      throw ApiError(503, "generation is paused (/continue_generation resumes it)", "server_error");
    if (loop->memory_released())
      throw ApiError(503, "memory is released (/resume_memory_occupation restores it)",
                     "server_error");
    std::unique_lock<std::mutex> one_at_a_time(health_mu);
    if (Clock::now() - health_ok_at < std::chrono::seconds(1)) {
      res.status = 200;
      return;
    }
    Job j;
    j.prompt = {0};
    j.params.max_tokens = 1;
    j.params.temperature = 0.f;
    j.params.ignore_eos = true;
    auto ch = std::make_shared<Channel>(1, false);
    const std::string rid = fresh_id("HEALTH_CHECK");
    std::vector<Job> jobs;
    jobs.push_back(std::move(j));
    const std::vector<uint64_t> ids = loop->submit(std::move(jobs), ch, rid);
    const auto deadline =
        Clock::now() + std::chrono::duration<double>(opts.health_generate_timeout_seconds);
    std::vector<std::optional<RequestOutput>> outs;
    uint64_t seen = 0;
    while (Clock::now() < deadline) {
      if (std::string f = ch->failure(); !f.empty()) throw ApiError(503, f, "server_error");
      if (ch->take(seen, std::chrono::milliseconds(100), outs) && outs[0] && outs[0]->finished) {
        health_ok_at = Clock::now();
        res.status = 200;
        return;
      }
    }
    loop->abort(ids);
    throw ApiError(503,
                   "health_generate: no token within " +
                       std::to_string(int(opts.health_generate_timeout_seconds)) +
                       " s (engine paused, stalled or overloaded)",
                   "server_error");
  }

  json server_info() {
    const EngineConfig& c = engine_cfg;
    const LoopStats st = loop->stats();
    const ModelConfig& m = loop->model_config();
    json args = {{"model_path", c.model},
                 {"served_model_name", opts.model_name},
                 {"host", opts.host},
                 {"port", port},
                 {"tp_size", 1},
                 {"dp_size", 1},
                 {"max_running_requests", c.max_num_seqs},
                 {"chunked_prefill_size", c.max_num_batched_tokens},
                 {"page_size", st.engine.block_size},
                 {"disable_radix_cache", !c.enable_prefix_caching},
                 {"kv_cache_dtype", st.engine.kv_cache_dtype},
                 {"enable_return_routed_experts", c.enable_return_routed_experts},
                 {"enable_overlap_schedule", c.overlap_scheduler},
                 {"ep_num_redundant_experts", c.eplb_redundant_experts},
                 {"speculative_algorithm",
                  c.speculative_algorithm.empty() ? json(nullptr) : json(c.speculative_algorithm)},
                 {"speculative_num_draft_tokens", c.speculative_num_draft_tokens},
                 {"context_length", m.max_position_embeddings},
                 {"weight_version", loop->weight_label()}};
    json out = args;
    out["status"] = "ready";
    out["max_total_num_tokens"] = int64_t(st.engine.num_blocks) * st.engine.block_size;
    out["max_req_input_len"] = m.max_position_embeddings - 1;
    json state = args;
    state["paused"] = loop->paused();
    state["memory_released"] = loop->memory_released();
    state["num_running_reqs"] = st.engine.running;
    state["num_waiting_reqs"] = st.engine.waiting;
    state["weight_version_counter"] = st.engine.weight_version;
    out["internal_states"] = json::array({state});
    out["version"] = "r3";
    return out;
  }

  json model_info() {
    const ModelConfig& m = loop->model_config();
    return {{"model_path", engine_cfg.model},
            {"tokenizer_path", !loop->tokenizer()             ? json(nullptr)
                               : engine_cfg.tokenizer.empty() ? json(engine_cfg.model)
                                                              : json(engine_cfg.tokenizer)},
            {"is_generation", true},
            {"preferred_sampling_params", nullptr},
            {"weight_version", loop->weight_label()},
            {"has_image_understanding", false},
            {"has_audio_understanding", false},
            {"model_type", arch_short_name(m.arch)},
            {"architectures", json::array({m.architecture})},
            {"r3_model_config", model_config_json(m)}};
  }

  // SGLang's /v1/loads: one data-parallel rank.
  json loads() {
    const LoopStats st = loop->stats();
    const EngineStats& e = st.engine;
    const int64_t total = int64_t(e.num_blocks) * e.block_size;
    const int64_t used = int64_t(e.num_blocks - e.free_blocks) * e.block_size;
    const double usage = total ? double(used) / double(total) : 0.0;
    const double hit = e.prefix_queried_tokens
                           ? double(e.prefix_hit_tokens) / double(e.prefix_queried_tokens)
                           : 0.0;
    json load = {{"dp_rank", 0},
                 {"num_running_reqs", e.running},
                 {"num_waiting_reqs", e.waiting},
                 {"num_total_reqs", e.running + e.waiting},
                 {"num_used_tokens", used},
                 {"num_total_tokens", total},
                 {"max_total_num_tokens", total},
                 {"max_running_requests", engine_cfg.max_num_seqs},
                 {"token_usage", usage},
                 {"cache_hit_rate", hit},
                 {"utilization", double(e.running) / double(std::max(1, engine_cfg.max_num_seqs))}};
    char ts[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    return {{"timestamp", ts},
            {"version", "r3"},
            {"dp_rank_count", 1},
            {"loads", json::array({load})},
            {"aggregate",
             {{"total_running_reqs", e.running},
              {"total_waiting_reqs", e.waiting},
              {"total_reqs", e.running + e.waiting},
              {"total_used_tokens", used},
              {"total_tokens", total},
              {"avg_token_usage", usage}}}};
  }

  // tags: "kv_cache", "weights" (SGLang's "cuda_graph" has nothing to free on a CPU); none = all.
  void memory_occupation(const httplib::Request& hreq, httplib::Response& res, bool release) {
    json body = hreq.body.empty() ? json::object() : parse_body(hreq.body);
    refuse_unknown_fields(body, "", {"tags"});
    bool kv = true, weights = true;
    if (body.contains("tags") && !body["tags"].is_null()) {
      if (!body["tags"].is_array()) throw bad_request("\"tags\" must be a list", "tags");
      if (!body["tags"].empty()) kv = weights = false;
      for (auto& t : body["tags"]) {
        const std::string tag = t.is_string() ? t.get<std::string>() : t.dump();
        if (tag == "kv_cache")
          kv = true;
        else if (tag == "weights")
          weights = true;
        else if (tag != "cuda_graph")
          throw bad_request("unknown tag \"" + tag + "\" (kv_cache, weights, cuda_graph)", "tags");
      }
    }
    if (release)
      loop->release_memory(kv, weights);
    else
      loop->resume_memory(kv, weights);
    send_json(res, 200,
              {{"success", true},
               {"message", std::string(release ? "released" : "resumed") + (kv ? " kv_cache" : "") +
                               (weights ? " weights" : "")}});
  }

  void abort(const httplib::Request& hreq, httplib::Response& res) {
    json body = parse_body(hreq.body);
    if (opt_bool(body, "abort_all", "abort_all").value_or(false)) {
      send_json(res, 200, {{"success", true}, {"aborted", loop->abort_all()}});
      return;
    }
    std::string rid;
    for (const char* k : {"rid", "request_id"}) {
      if (!body.contains(k) || body[k].is_null()) continue;
      if (body[k].is_string())
        rid = body[k].get<std::string>();
      else if (body[k].is_number_integer())
        rid = body[k].dump();
      else
        throw bad_request(std::string("\"") + k + "\" must be a string", k);
      break;
    }
    if (rid.empty()) throw bad_request("missing \"rid\" (or \"request_id\")", "rid");
    send_json(res, 200, {{"success", true}, {"aborted", loop->abort_rid(rid)}});
  }

  // What both listeners share: socket options, body and time limits, error replies, counters.
  void configure(GatedHttpServer& srv, int threads, socket_t* fd_out) {
    // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which would let a second
    // server silently share the port. The fd is kept to raise the listen backlog after bind.
    srv.set_socket_options([fd_out](socket_t sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof yes);
      *fd_out = sock;
    });
    // post() enforces each endpoint's cap; httplib's own must not undercut the largest one.
    srv.set_payload_max_length(std::max(opts.max_body_bytes, opts.max_weights_body_bytes));
    // httplib's accept loop only hands each connection to the gate: one thread is plenty.
    srv.new_task_queue = [] { return new httplib::ThreadPool(1); };
    // Requests are handled by `threads` workers once whole; slow and idle clients wait in the
    // gate without a thread: headers within read_timeout_seconds, keep-alive 5 s idle.
    GateLimits gate;
    gate.workers = threads;
    gate.header_seconds = opts.read_timeout_seconds;
    gate.io_seconds = opts.read_timeout_seconds;
    gate.idle_seconds = 5;
    gate.max_connections = opts.max_connections;
    srv.set_gate_limits(gate);
    srv.set_error_handler(httplib::Server::HandlerWithResponse(
        [this](const httplib::Request&, httplib::Response& res) {
          if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
          std::string msg;
          if (res.status == 404)
            msg = "no such endpoint (or wrong method)";
          else if (res.status == 413)
            msg = "request body is larger than " + std::to_string(opts.max_body_bytes) +
                  " bytes (--max-body-bytes)";
          else
            msg = "HTTP error " + std::to_string(res.status);
          send_json(res, res.status, error_body(msg, status_type(res.status), "", res.status));
          return httplib::Server::HandlerResponse::Handled;
        }));
    srv.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
          send_json(res, 500, error_body("internal error", "server_error", "", 500));
        });
    srv.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      const std::string ep =
          is_served(req.path) ? req.path : "other";  // unknown paths are not labels
      {
        std::lock_guard<std::mutex> lk(counters_mu);
        ++counters.responses[{ep, res.status}];
      }
      if (opts.log_requests)
        std::fprintf(stderr, "r3 serve: %s %s %d\n", req.method.c_str(), req.path.c_str(),
                     res.status);
    });
  }

  void health(httplib::Response& res) {
    if (std::string f = loop->failure(); !f.empty())
      throw ApiError(503, "the engine failed: " + f, "server_error");
    if (const double t = loop->seconds_in_step(); t > opts.stall_seconds)
      throw ApiError(
          503, "the engine loop is stalled: one step has run for " + std::to_string(int(t)) + " s",
          "server_error");
    if (stopped || draining) throw ApiError(503, "server shutting down", "server_error");
    send_json(res, 200, {{"status", "ok"}});
  }

  void metrics(httplib::Response& res) {
    LoopStats st = loop->stats();
    HttpCounters c;
    {
      std::lock_guard<std::mutex> lk(counters_mu);
      c = counters;
    }
    res.set_content(prometheus_text(st, c, opts.model_name),
                    "text/plain; version=0.0.4; charset=utf-8");
  }

  void update_weight_version(const httplib::Request& q, httplib::Response& res) {
    json body = parse_body(q.body);
    refuse_unknown_fields(body, "", {"new_version", "abort_all_requests"});
    auto v = opt_string(body, "new_version", "new_version");
    if (!v) throw bad_request("missing \"new_version\"", "new_version");
    if (opt_bool(body, "abort_all_requests", "abort_all_requests").value_or(false))
      loop->abort_all();
    loop->set_weight_label(*v);
    send_json(
        res, 200,
        {{"success", true}, {"message", "Weight version updated to " + *v}, {"new_version", *v}});
  }

  json models() const {
    json m = {{"id", opts.model_name},
              {"object", "model"},
              {"created", started},
              {"owned_by", "r3"},
              {"root", engine_cfg.model},
              {"max_model_len", loop->model_config().max_position_embeddings}};
    return {{"object", "list"}, {"data", json::array({m})}};
  }

  // The endpoint table: one row per endpoint (its aliases share the row), from which routing,
  // the API-key check, the body cap, /metrics' endpoint labels, Server::endpoints() and the
  // README's table test all derive. Adding an endpoint is one row (and its README line).
  enum class Access { ApiKey, Open };  // Open: probes, as SGLang's middleware lets /health* through
  enum class Cap {
    Request,
    Weights
  };  // a POST body's: --max-body-bytes or --max-weights-body-bytes
  enum class Port { Main, AlsoControl };
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  // The handler of the one endpoint that takes its body (the request post() read, its only copy).
  using BodyTaker = std::function<void(httplib::Request&, httplib::Response&)>;
  struct Endpoint {
    const char* method;  // "GET" or "POST"
    std::vector<const char*> paths;
    Handler handler;
    Access access = Access::ApiKey;
    Port port = Port::Main;
    Cap cap = Cap::Request;  // POST
    BodyTaker takes_body = {};
    BodyStart body_start = {};
  };

  std::vector<Endpoint> endpoint_table() {
    using R = const httplib::Request&;
    using W = httplib::Response&;
    auto get = [](std::vector<const char*> paths, Handler h, Access a = Access::ApiKey,
                  Port port = Port::Main) {
      return Endpoint{"GET", std::move(paths), std::move(h), a, port};
    };
    auto post = [](std::vector<const char*> paths, Handler h, Port port = Port::Main) {
      return Endpoint{"POST", std::move(paths), std::move(h), Access::ApiKey, port};
    };
    Endpoint tensor_update{"POST", {"/update_weights_from_tensor"}, nullptr};
    tensor_update.cap = Cap::Weights;
    tensor_update.takes_body = [this](httplib::Request& q, W s) {
      update_weights_from_tensor(q, s);
    };
    tensor_update.body_start = {
        [this](std::string_view got) { return loop->check_tensor_body_start(got); },
        [](httplib::Response& s, const std::string& why) {
          send_json(s, 400, {{"success", false}, {"message", why}});
        }};
    return {
        post({"/v1/completions"}, [this](R q, W s) { completions(q, s, false); }),
        post({"/v1/chat/completions"}, [this](R q, W s) { completions(q, s, true); }),
        post({"/generate"}, [this](R q, W s) { generate(q, s); }),
        post({"/tokenize"},
             [this](R q, W s) {
               send_json(s, 200,
                         tokenize_reply(parse_body(q.body), loop->tokenizer().get(),
                                        loop->model_config().max_position_embeddings));
             }),
        post({"/detokenize"},
             [this](R q, W s) {
               send_json(s, 200, detokenize_reply(parse_body(q.body), loop->tokenizer().get()));
             }),
        post({"/update_weights", "/update_weights_from_disk"},
             [this](R q, W s) { update_weights(q, s); }),
        tensor_update,
        post({"/update_weight_version"}, [this](R q, W s) { update_weight_version(q, s); }),
        post({"/pause_generation"}, [this](R q, W s) { pause_generation(q, s); }),
        post({"/continue_generation"}, [this](R q, W s) { continue_generation(q, s); }),
        get({"/flush_cache"}, [this](R, W s) { flush_cache(s); }),
        post({"/flush_cache"}, [this](R, W s) { flush_cache(s); }),
        post({"/release_memory_occupation"}, [this](R q, W s) { memory_occupation(q, s, true); }),
        post({"/resume_memory_occupation"}, [this](R q, W s) { memory_occupation(q, s, false); }),
        post(
            {"/abort", "/abort_request"}, [this](R q, W s) { abort(q, s); }, Port::AlsoControl),
        get({"/get_server_info", "/server_info"},
            [this](R, W s) { send_json(s, 200, server_info()); }),
        get({"/get_model_info", "/model_info"},
            [this](R, W s) { send_json(s, 200, model_info()); }),
        get({"/get_weight_version", "/weight_version"},
            [this](R, W s) {
              send_json(s, 200, {{"weight_version", loop->weight_label()}});
            }),
        get({"/v1/loads"}, [this](R, W s) { send_json(s, 200, loads()); }),
        get({"/v1/models"}, [this](R, W s) { send_json(s, 200, models()); }),
        get(
            {"/metrics"}, [this](R, W s) { metrics(s); }, Access::ApiKey, Port::AlsoControl),
        get(
            {"/health"}, [this](R, W s) { health(s); }, Access::Open, Port::AlsoControl),
        get(
            {"/health_generate"}, [this](R, W s) { health_generate(s); }, Access::Open),
    };
  }

  void serve(GatedHttpServer& s, const Endpoint& e) {
    const bool key = e.access == Access::ApiKey, is_get = std::string(e.method) == "GET";
    const size_t cap = is_get                  ? 0
                       : e.cap == Cap::Weights ? opts.max_weights_body_bytes
                                               : opts.max_body_bytes;
    for (const char* path : e.paths) {
      if (is_get) {
        s.Get(path, wrap(key, e.handler));
      } else {
        BodyTaker fn = e.takes_body;
        if (!fn) fn = [h = e.handler](httplib::Request& q, httplib::Response& r) { h(q, r); };
        s.Post(path, post(std::move(fn), key, cap, e.body_start));
      }
      served.push_back({e.method, path, &s == &control, key, cap});
    }
  }
  bool is_served(const std::string& path) const {
    for (const ServedEndpoint& e : served)
      if (e.path == path) return true;
    return false;
  }

  void routes() {
    configure(http, std::max(1, opts.http_threads), &listen_fd);
    // The control listener: its own threads, so /health and /abort answer even while clients
    // hold every connection slot of the main port.
    configure(control, 4, &control_fd);
    for (const Endpoint& e : endpoint_table()) {
      serve(http, e);
      if (e.port == Port::AlsoControl) serve(control, e);
    }
  }
};

Server::Server(EngineConfig engine, ServerOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
  impl_->engine_cfg = engine;
  if (impl_->opts.model_name.empty()) impl_->opts.model_name = engine.model;
  impl_->loop = std::make_unique<EngineLoop>(std::move(engine));
  impl_->loop->set_weight_label(impl_->opts.weight_version);
  impl_->routes();
}

Server::~Server() {
  stop();
  if (impl_->bg.joinable()) impl_->bg.join();
  if (impl_->control_bg.joinable()) impl_->control_bg.join();
}

int Server::bind() {
  if (impl_->port >= 0) return impl_->port;
  const auto& o = impl_->opts;
  if (o.port == 0) {
    impl_->port = impl_->http.bind_to_any_port(o.host);
  } else if (impl_->http.bind_to_port(o.host, o.port)) {
    impl_->port = o.port;
  }
  if (impl_->port < 0) throw Error("cannot listen on " + o.host + ":" + std::to_string(o.port));
  // httplib listens with a backlog of 5: a burst of connections would wait for SYN retries
  // (1 s). Listening again on the bound socket raises the backlog.
  if (impl_->listen_fd >= 0) ::listen(impl_->listen_fd, SOMAXCONN);
  if (o.control_port >= 0) {
    if (o.control_port == 0)
      impl_->control_port = impl_->control.bind_to_any_port(o.host);
    else if (impl_->control.bind_to_port(o.host, o.control_port))
      impl_->control_port = o.control_port;
    if (impl_->control_port < 0)
      throw Error("cannot listen on " + o.host + ":" + std::to_string(o.control_port) +
                  " (--control-port)");
    impl_->control_bg = std::thread([this] { impl_->control.listen_after_bind(); });
    while (!impl_->control.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return impl_->port;
}

void Server::listen() {
  bind();
  if (impl_->stopped) return;
  impl_->http.listen_after_bind();
}

int Server::start() {
  const int p = bind();
  impl_->bg = std::thread([this] { impl_->http.listen_after_bind(); });
  while (!impl_->http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return p;
}

size_t Server::shutdown(std::chrono::milliseconds grace) {
  impl_->draining = true;
  const size_t aborted = impl_->loop->drain(grace);
  stop();
  return aborted;
}

void Server::stop() {
  std::lock_guard<std::mutex> lk(impl_->stop_mu);
  if (impl_->stopped.exchange(true)) return;
  impl_->loop->shutdown();  // waiting calls answer 503 now, so the HTTP threads can finish
  impl_->http.stop();
  impl_->control.stop();
  impl_->http.stop_gate();
  impl_->control.stop_gate();
}

std::string Server::startup_line() const { return impl_->loop->startup().line(); }

int Server::port() const { return impl_->port; }
int Server::control_port() const { return impl_->control_port; }

const std::vector<ServedEndpoint>& Server::endpoints() const { return impl_->served; }

}  // namespace r3::server
