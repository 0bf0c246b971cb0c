// `r3 serve`: the HTTP front of one engine. Endpoints (see docs in server.cc):
//   POST /v1/completions   OpenAI style, token-id prompts, SSE streaming, routes as extensions
//   POST /generate         SGLang style
//   POST /update_weights   refit from a checkpoint directory (also /update_weights_from_disk)
//   POST /abort            abort by "rid" / "request_id" (also /abort_request)
//   GET  /health, /v1/models, /metrics
//   and, with ServerOptions::control_port, GET /health, /metrics and POST /abort on a second port
// HTTP threads parse and validate, then hand requests to the EngineLoop thread, which alone
// touches the engine. Every error is a 4xx/5xx JSON reply; the server keeps serving.
#pragma once
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace r3::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0 = any free port (see Server::port())
  // A second listener for /health, /metrics and /abort with threads of its own, so they answer
  // while slow or idle clients hold every slot of the main port. -1 = none, 0 = any free port.
  int control_port = -1;
  std::string api_key;                // non-empty: every endpoint but /health needs "Bearer KEY"
  size_t max_body_bytes = 16u << 20;  // larger bodies get 413
  size_t max_weights_body_bytes = size_t(4)
                                  << 30;  // /update_weights_from_tensor (a bucket of weights)
  int http_threads = 128;  // requests handled at once (whole requests: see max_connections)
  // Connections held at once; slow and idle ones wait without a thread, and past this the
  // longest-idle is closed first (gated_http_server.h).
  size_t max_connections = 4096;
  std::string model_name;         // reported by /v1/models; default: the model path
  bool log_requests = false;      // one line per request on stderr
  int read_timeout_seconds = 10;  // a request's headers in all; one read of a body chunk
  int body_timeout_seconds = 60;  // a whole request body
  double stall_seconds = 120;     // /health says 503 while one engine step runs longer
  double health_generate_timeout_seconds =
      20;                            // /health_generate's one-token generation (SGLang: 20)
  std::string weight_version = "0";  // the initial weight version label
  // vLLM's --trust-request-chat-template: render a chat request's own "chat_template" (code
  // from the client; every render runs within text/jinja_budget.h's budget either way).
  bool trust_request_chat_template = false;
  // SGLang's --incremental-streaming-output: a streamed /generate chunk carries only what is new
  // since the last (text, output_ids, output_token_logprobs, weight_versions and the route rows,
  // whose first is meta_info.routed_experts_start_len); off, each chunk is the reply so far.
  bool incremental_streaming_output = false;
  // Route wire format when a request names none: "" = each endpoint's peer default (/generate:
  // sglang, /v1/completions: vllm), else r3 | sglang | vllm | nrlre1 for both.
  std::string routed_experts_format;
};

// One route: its method, path, and whether it is on the control listener (--control-port) rather
// than the main one.
// A route as served: from the endpoint table in server.cc (one row per endpoint).
struct ServedEndpoint {
  std::string method, path;
  bool control = false;   // on the control port (the same endpoint is also listed for the main one)
  bool needs_key = true;  // the API key is checked (when --api-key is set); false for the probes
  size_t body_cap =
      0;  // POST: bytes of body accepted (--max-body-bytes or --max-weights-body-bytes)
};

class Server {
 public:
  // Loads the model and starts the engine loop (throws r3::Error).
  Server(EngineConfig engine, ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The engine's start-up figures (StartupReport::line).
  std::string startup_line() const;
  // Binds host:port; returns the bound port. Throws r3::Error when the address is taken.
  int bind();
  // Serves until stop() (binds first if needed). Blocks.
  void listen();
  // bind() + listen() on a background thread; returns the bound port.
  int start();
  // Stops serving: pending calls get 503, the engine loop ends. Idempotent, any thread.
  void stop();
  // Graceful stop (SIGTERM): new requests get 503, requests in flight finish until `grace` has
  // passed and are aborted after it (their callers get the abort reply), then stop(). Returns
  // how many were aborted.
  size_t shutdown(std::chrono::milliseconds grace);
  int port() const;
  int control_port() const;  // -1 without a control listener
  // Every route, in the order registered (the HTTP responses metric labels these paths).
  const std::vector<ServedEndpoint>& endpoints() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace r3::server
