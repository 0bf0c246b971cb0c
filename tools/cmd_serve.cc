#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "engine_flags.h"
#include "routes/route_formats.h"
#include "server/server.h"

namespace r3::cli {

int cmd_serve(int argc, char** argv) {
  Args a("serve",
         "Serves one engine over HTTP: POST /v1/completions (OpenAI style, token-id prompts, SSE\n"
         "streaming, \"return_routed_experts\"), POST /generate (SGLang style), POST "
         "/update_weights,\n"
         "POST /abort, GET /health, GET /v1/models, GET /metrics (Prometheus). Binds 127.0.0.1 "
         "unless\n"
         "--host says otherwise; with --api-key every endpoint but /health needs\n"
         "\"Authorization: Bearer KEY\". On SIGINT/SIGTERM it stops admitting requests, lets those "
         "in\n"
         "flight finish (--shutdown-grace-seconds), then exits.");
  add_engine_flags(a);
  a.opt("host", "127.0.0.1", "address to bind (0.0.0.0 = every interface)")
      .opt("port", "8000", "TCP port (0 = any free port, printed at start)")
      .opt("api-key", "",
           "require \"Authorization: Bearer KEY\" (the R3_API_KEY variable also sets it)")
      .opt("max-body-bytes", std::to_string(16u << 20), "larger request bodies get 413")
      .opt("max-weights-body-bytes", std::to_string(size_t(4) << 30),
           "larger /update_weights_from_tensor bodies get 413 (send buckets)")
      .opt("http-threads", "128",
           "HTTP requests handled at once (slow and idle connections wait without a thread)")
      .opt("max-connections", "4096",
           "connections held at once; past it the longest-idle one is closed first")
      .opt("control-port", "-1",
           "also serve /health, /metrics and /abort on this port, with threads of their own (-1 = "
           "off, 0 = any free port)")
      .opt("served-model-name", "", "model id in /v1/models and replies (default: --model)")
      .opt("routed-experts-format", "",
           "route wire format when a request names none: sglang, vllm, r3 or nrlre1 (default: "
           "sglang on /generate, vllm on /v1/completions)")
      .opt("weight-version", "0",
           "initial weight version label (a string; refits set it, SGLang's weight_version)")
      .opt("shutdown-grace-seconds", "30",
           "on SIGTERM/SIGINT: requests in flight may finish for this long, then are aborted")
      .opt("health-stall-seconds", "120",
           "/health answers 503 while one engine step has run longer than this")
      .flag(
          "trust-request-chat-template", false,
          "render a chat request's own \"chat_template\" (off: such requests get 400, as in vLLM)")
      .flag("incremental-streaming-output", false,
            "streamed /generate chunks carry only what is new (text, output_ids, logprobs, route "
            "rows), as "
            "SGLang's flag; off: each chunk is the reply so far, routes in the last")
      .flag("log-requests", false, "one line per HTTP request on stderr");
  if (!a.parse(argc, argv)) return 0;
  EngineConfig cfg = engine_config_from(a);
  server::ServerOptions o;
  o.host = a.str("host");
  o.port = int(a.integer("port"));
  if (o.port < 0 || o.port > 65535) throw Error("--port must be in [0, 65535]");
  o.api_key = a.str("api-key");
  if (o.api_key.empty())
    if (const char* k = std::getenv("R3_API_KEY")) o.api_key = k;
  const int64_t body = a.integer("max-body-bytes");
  if (body <= 0) throw Error("--max-body-bytes must be positive");
  o.max_body_bytes = size_t(body);
  const int64_t wbody = a.integer("max-weights-body-bytes");
  if (wbody <= 0) throw Error("--max-weights-body-bytes must be positive");
  o.max_weights_body_bytes = size_t(wbody);
  o.http_threads = int(a.integer("http-threads"));
  if (o.http_threads <= 0) throw Error("--http-threads must be positive");
  const int64_t conns = a.integer("max-connections");
  if (conns <= 0) throw Error("--max-connections must be positive");
  o.max_connections = size_t(conns);
  o.model_name = a.str("served-model-name");
  o.weight_version = a.str("weight-version");
  o.trust_request_chat_template = a.on("trust-request-chat-template");
  o.incremental_streaming_output = a.on("incremental-streaming-output");
  o.routed_experts_format = a.str("routed-experts-format");
  if (!o.routed_experts_format.empty())
    (void)parse_route_format(o.routed_experts_format);  // fails early on a typo
  o.control_port = int(a.integer("control-port"));
  if (o.control_port < -1 || o.control_port > 65535)
    throw Error("--control-port must be -1 (off) or in [0, 65535]");
  o.log_requests = a.on("log-requests");
  const double grace = a.number("shutdown-grace-seconds");
  if (!(grace >= 0)) throw Error("--shutdown-grace-seconds must be >= 0");
  o.stall_seconds = a.number("health-stall-seconds");
  if (!(o.stall_seconds > 0)) throw Error("--health-stall-seconds must be positive");

  // Every thread (engine, HTTP) inherits this mask; one thread waits for the signals.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  server::Server srv(cfg, o);
  const int port = srv.bind();
  std::fprintf(stderr, "r3 serve: %s on http://%s:%d%s\n",
               o.model_name.empty() ? cfg.model.c_str() : o.model_name.c_str(), o.host.c_str(),
               port, o.api_key.empty() ? "" : " (API key required)");
  // After the address line, which clients read first to learn the port.
  std::fprintf(stderr, "r3 serve: %s\n", srv.startup_line().c_str());
  if (srv.control_port() >= 0)
    std::fprintf(stderr,
                 "r3 serve: control endpoints (/health, /metrics, /abort) on http://%s:%d\n",
                 o.host.c_str(), srv.control_port());
  std::fflush(stderr);
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (sig == SIGTERM || sig == SIGINT) {
      std::fprintf(stderr, "r3 serve: stopping: finishing requests in flight (up to %.0f s)\n",
                   grace);
      const size_t aborted = srv.shutdown(std::chrono::milliseconds(int64_t(grace * 1000)));
      if (aborted)
        std::fprintf(stderr, "r3 serve: %zu requests aborted at the end of the grace period\n",
                     aborted);
    }
    srv.stop();
  });
  srv.listen();
  srv.stop();
  pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter if listen ended by itself
  waiter.join();
  std::fprintf(stderr, "r3 serve: stopped\n");
  return 0;
}

}  // namespace r3::cli
