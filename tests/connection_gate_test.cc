// Issue 48: slow and idle clients cannot stop r3 serve. Connections wait in the gate
// (src/server/gated_http_server.h) without a thread until a whole request has arrived, so under
// 2,000 idle and 300 slowloris connections /health answers within 1 s on both ports and
// requests keep their latency; a slowloris connection gets 408 at its header deadline, and past
// the connection cap the oldest waiting connections are shed so new clients are served.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "engine_test_util.h"
#include "server/gated_http_server.h"
#include "server/server.h"
#include "test_models.h"

namespace r3 {
namespace {

using Clock = std::chrono::steady_clock;

int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

EngineConfig small_engine() {
  EngineConfig c;
  c.model = testing::test_model("olmoe");
  c.num_kv_blocks = 64;
  c.max_num_seqs = 4;
  c.threads = 1;
  return c;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One small completion, timed.
double completion_seconds(int port) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(30, 0);
  const auto t0 = Clock::now();
  auto r =
      cli.Post("/v1/completions", R"({"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0})",
               "application/json");
  EXPECT_TRUE(r && r->status == 200);
  return seconds_since(t0);
}

double median_completion_seconds(int port) {
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) t.push_back(completion_seconds(port));
  std::sort(t.begin(), t.end());
  return t[2];
}

double health_seconds(int port) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(5, 0);
  cli.set_read_timeout(5, 0);
  const auto t0 = Clock::now();
  auto h = cli.Get("/health");
  EXPECT_TRUE(h && h->status == 200);
  return seconds_since(t0);
}

TEST(ConnectionGate, IdleFloodsAndSlowlorisStopNeitherPort) {
  server::ServerOptions o;
  o.port = 0;
  o.control_port = 0;
  o.http_threads = 8;
  server::Server srv(small_engine(), o);
  const int port = srv.start(), control = srv.control_port();
  const double unloaded = median_completion_seconds(port);
  std::vector<int> idle, slow;
  for (int i = 0; i < 2000; ++i) {
    const int fd = connect_to(port);
    ASSERT_GE(fd, 0) << i;
    idle.push_back(fd);
  }
  for (int i = 0; i < 308; ++i) {  // 300 on the main port, 8 on the control port
    const int fd = connect_to(i < 300 ? port : control);
    ASSERT_GE(fd, 0) << i;
    slow.push_back(fd);
  }
  std::atomic<bool> done{false};
  std::thread slowloris([&] {  // one header byte per connection per 200 ms
    const std::string line = "GET /health HTTP/1.1\r\nX-Slow: ";
    for (size_t k = 0; !done; ++k) {
      for (int fd : slow)
        (void)!send(fd, line.data() + std::min(k, line.size() - 1), 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(health_seconds(port), 1.0);
  EXPECT_LT(health_seconds(control), 1.0);
  const double loaded = median_completion_seconds(port);
  std::printf(
      "[ gate ] completion median unloaded %.1f ms, under 2000 idle + 300 slowloris %.1f ms\n",
      unloaded * 1e3, loaded * 1e3);
  EXPECT_LT(loaded, std::max(2 * unloaded, unloaded + 0.05));
  done = true;
  slowloris.join();
  for (int fd : idle) close(fd);
  for (int fd : slow) close(fd);
  srv.stop();
}

TEST(ConnectionGate, SlowHeadersGet408AtTheirDeadline) {
  server::ServerOptions o;
  o.port = 0;
  o.read_timeout_seconds = 1;
  server::Server srv(small_engine(), o);
  const int port = srv.start();
  const int fd = connect_to(port);
  ASSERT_GE(fd, 0);
  const auto t0 = Clock::now();
  std::string got;
  const std::string line = "GET /health HTTP/1.1\r\n";
  for (size_t k = 0; k < line.size() && seconds_since(t0) < 5; ++k) {
    if (send(fd, line.data() + k, 1, MSG_NOSIGNAL) != 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
  }
  char buf[512];
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const ssize_t n = recv(fd, buf, sizeof buf, 0);
  if (n > 0) got.assign(buf, size_t(n));
  EXPECT_EQ(got.rfind("HTTP/1.1 408", 0), 0u) << got;
  EXPECT_LT(seconds_since(t0), 3.0);
  close(fd);
  // A whole request sent slowly but within the deadline is served.
  const int ok = connect_to(port);
  const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  for (char ch : req) {
    (void)!send(ok, &ch, 1, MSG_NOSIGNAL);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const ssize_t m = recv(ok, buf, sizeof buf, 0);
  EXPECT_GT(m, 12);
  EXPECT_EQ(std::string(buf, size_t(std::max<ssize_t>(m, 0))).rfind("HTTP/1.1 200", 0), 0u);
  close(ok);
  srv.stop();
}

TEST(ConnectionGate, PastTheCapTheOldestWaitingConnectionsAreShed) {
  server::ServerOptions o;
  o.port = 0;
  o.max_connections = 50;
  server::Server srv(small_engine(), o);
  const int port = srv.start();
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(connect_to(port));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_LT(health_seconds(port), 1.0);  // a new client is served: older waiting ones made room
  // The first connections were shed: a 503 saying why, then the end of the connection.
  timeval tv{2, 0};
  setsockopt(idle[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string got;
  char buf[512];
  for (ssize_t n; (n = recv(idle[0], buf, sizeof buf, 0)) > 0;) got.append(buf, size_t(n));
  EXPECT_EQ(got.rfind("HTTP/1.1 503", 0), 0u) << got;
  EXPECT_NE(got.find("too many connections"), std::string::npos) << got;
  for (int fd : idle) close(fd);
  srv.stop();
}

// A handler can tell that its client left (a chat-template render polls this to stop early).
TEST(ConnectionGate, HandlersSeeTheirClientLeave) {
  server::GatedHttpServer srv;
  std::atomic<double> noticed{-1};
  srv.Get("/wait", [&](const httplib::Request&, httplib::Response& res) {
    const auto t0 = Clock::now();
    while (!server::GatedHttpServer::client_gone() && seconds_since(t0) < 5)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    noticed = seconds_since(t0);
    res.set_content("late", "text/plain");
  });
  EXPECT_FALSE(server::GatedHttpServer::client_gone());  // not on a worker
  const int port = srv.bind_to_any_port("127.0.0.1");
  std::thread listener([&] { srv.listen_after_bind(); });
  while (!srv.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const int fd = connect_to(port);
  const std::string req = "GET /wait HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  close(fd);
  const auto t0 = Clock::now();
  while (noticed < 0 && seconds_since(t0) < 10)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GT(noticed.load(), 0.1);
  EXPECT_LT(noticed.load(), 1.5);
  srv.stop();
  srv.stop_gate();
  listener.join();
}

}  // namespace
}  // namespace r3
