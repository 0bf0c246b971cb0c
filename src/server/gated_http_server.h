// The HTTP listener of r3 serve: cpp-httplib's request handling (parsing, routing, replies,
// SSE) behind a connection gate that holds connections without threads until a whole request
// has arrived. cpp-httplib (0.11) gives every accepted connection a pool thread that reads it
// byte by byte with a per-read timeout, so 300 slowloris clients (a header byte every 4 s) or a
// few thousand idle connections hold every thread and the port serves nothing.
//
// Here the accepted socket goes to one epoll thread instead. It peeks (never consumes) until the
// request line, headers and a small body (Content-Length up to kGatedBodyBytes) are all there,
// then hands the socket to a worker, which runs httplib's process_request on it; a kept-alive
// connection goes back to the gate between requests. Limits: a request's headers must arrive
// within `header_seconds` of its first byte being awaited (else 408 and close), a keep-alive
// connection idle for `idle_seconds` is closed, headers over kMaxGatedHeaderBytes get 431, and
// past `max_connections` the longest-idle connection is shed first (then the slowest header).
// Workers only ever hold requests that have arrived, so requests in flight and new ones are
// served whatever slow or idle clients do.
#pragma once
#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace r3::server {

// Both fit a socket's default receive buffer, so a peek can see them whole.
inline constexpr size_t kMaxGatedHeaderBytes = 32 * 1024;
inline constexpr size_t kGatedBodyBytes = 16 * 1024;

struct GateLimits {
  int header_seconds = 10;        // request line + headers (+ a small body) must arrive within this
  int idle_seconds = 5;           // a keep-alive connection waiting for its next request
  int io_seconds = 10;            // one read or write by a worker (a large body, a reply)
  size_t max_connections = 4096;  // connections held at once, gate and workers together
  int workers = 16;               // requests handled at once
};

class GatedHttpServer : public httplib::Server {
 public:
  explicit GatedHttpServer(GateLimits limits = {});
  ~GatedHttpServer() override;
  // Must be called before listen_after_bind (the limits are read by the gate and workers).
  void set_gate_limits(const GateLimits& limits);
  // Closes every held connection and joins the gate and workers; httplib's stop() is separate.
  void stop_gate();
  // On a worker thread, inside a handler: whether the client of the request being handled has
  // closed its connection (long work such as a template render stops then). False elsewhere.
  static bool client_gone();
  // On a worker thread, inside a handler: close the connection after this reply (a body left
  // unread, which would otherwise be taken for the next request). No effect elsewhere.
  static void close_after_reply();

 private:
  struct Held {
    std::chrono::steady_clock::time_point deadline;
    uint64_t admitted = 0;  // admission order: ties of the clock must not decide who is oldest
    bool idle = false;      // between requests (shed first), else inside a request's headers
  };

  bool process_and_close_socket(socket_t sock) override;
  void start_threads();
  void gate_loop();
  void worker_loop();
  void admit(socket_t sock, bool idle);                    // into the gate (epoll), any thread
  void check_ready(socket_t sock);                         // gate thread: a whole request peekable?
  void release(socket_t sock, const std::string* answer);  // gate thread: forget, answer, close
  void shed_one();                                         // gate thread: make room for one more

  GateLimits limits_;
  int epoll_ = -1, wake_ = -1;  // wake_: an eventfd for admissions and stop
  std::once_flag started_;
  std::atomic<bool> stopping_{false};
  std::thread gate_;
  std::vector<std::thread> workers_;
  std::mutex mu_;  // guards incoming_ and ready_
  std::condition_variable ready_cv_;
  std::deque<std::pair<socket_t, bool>> incoming_;  // (socket, idle) to be added by the gate thread
  std::deque<socket_t> ready_;                      // whole requests, for the workers
  std::unordered_map<socket_t, Held> held_;         // gate thread only
  std::atomic<size_t> busy_{0};                     // sockets with a worker or queued for one
  uint64_t admissions_ = 0;                         // gate thread only: numbers held_ entries
};

}  // namespace r3::server
