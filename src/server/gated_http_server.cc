#include "server/gated_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>

namespace r3::server {

namespace {

using Clock = std::chrono::steady_clock;

void close_socket(socket_t s) {
  ::shutdown(s, SHUT_RDWR);
  ::close(s);
}

void address_of(const sockaddr_storage& a, std::string& ip, int& port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf);
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof buf);
    port = ntohs(in->sin6_port);
  }
  ip = buf;
}

// httplib's Stream over a connected socket whose request has arrived: every read and write
// waits at most `timeout_ms`; reads are buffered (httplib reads header lines a byte at a time).
class FdStream : public httplib::Stream {
 public:
  FdStream(socket_t s, int timeout_ms) : s_(s), timeout_ms_(timeout_ms) {}
  bool is_readable() const override { return have_ > at_ || wait(POLLIN); }
  bool is_writable() const override { return wait(POLLOUT); }
  ssize_t read(char* ptr, size_t size) override {
    if (have_ == at_) {
      if (size >= sizeof buf_) return receive(ptr, size);
      const ssize_t n = receive(buf_, sizeof buf_);
      if (n <= 0) return n;
      at_ = 0, have_ = size_t(n);
    }
    const size_t n = std::min(size, have_ - at_);
    std::memcpy(ptr, buf_ + at_, n);
    at_ += n;
    return ssize_t(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!wait(POLLOUT)) return -1;
    ssize_t n;
    do n = ::send(s_, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getpeername(s_, reinterpret_cast<sockaddr*>(&a), &len) == 0) address_of(a, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getsockname(s_, reinterpret_cast<sockaddr*>(&a), &len) == 0) address_of(a, ip, port);
  }
  socket_t socket() const override { return s_; }
  // Bytes read past the request just handled (a pipelined next request).
  bool has_buffered() const { return have_ > at_; }

 private:
  bool wait(short events) const {
    pollfd p{s_, events, 0};
    for (;;) {
      const int r = ::poll(&p, 1, timeout_ms_);
      if (r < 0 && errno == EINTR) continue;
      return r > 0 && (p.revents & events);
    }
  }
  ssize_t receive(char* ptr, size_t size) {
    if (!wait(POLLIN)) return -1;
    ssize_t n;
    do n = ::recv(s_, ptr, size, 0);
    while (n < 0 && errno == EINTR);
    return n;
  }

  socket_t s_;
  int timeout_ms_;
  char buf_[4096];
  size_t at_ = 0, have_ = 0;
};

// The Content-Length a header block declares (0 when none or not a plain number).
size_t content_length(std::string_view headers) {
  static constexpr std::string_view kName = "\r\ncontent-length:";
  for (size_t at = headers.find("\r\n"); at != std::string_view::npos;
       at = headers.find("\r\n", at + 2)) {
    if (headers.size() - at < kName.size() ||
        strncasecmp(headers.data() + at, kName.data(), kName.size()) != 0)
      continue;
    size_t i = at + kName.size(), v = 0;
    while (i < headers.size() && (headers[i] == ' ' || headers[i] == '\t')) ++i;
    for (; i < headers.size() && headers[i] >= '0' && headers[i] <= '9' && v < (size_t(1) << 50);
         ++i)
      v = v * 10 + size_t(headers[i] - '0');
    return v;
  }
  return 0;
}

// A whole reply the gate sends itself (r3's error body), then closes.
std::string reply(int status, const char* reason, const std::string& message, const char* type) {
  const std::string body = "{\"error\": {\"message\": \"" + message + "\", \"type\": \"" + type +
                           "\", \"param\": null, " + "\"code\": " + std::to_string(status) + "}}";
  return "HTTP/1.1 " + std::to_string(status) + " " + reason +
         "\r\nContent-Type: application/json\r\nConnection: close\r\n" +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}
const std::string kTimeoutReply = reply(
    408, "Request Timeout", "the request headers did not arrive in time", "invalid_request_error");
const std::string kTooLargeReply =
    reply(431, "Request Header Fields Too Large",
          "the request headers exceed " + std::to_string(kMaxGatedHeaderBytes) + " bytes",
          "invalid_request_error");
const std::string kBusyReply =
    reply(503, "Service Unavailable", "too many connections are open; retry", "server_error");

thread_local socket_t handled_socket = -1;  // the worker's connection, while process_request runs
thread_local bool close_requested = false;  // close_after_reply() was called for it

}  // namespace

void GatedHttpServer::close_after_reply() { close_requested = true; }

bool GatedHttpServer::client_gone() {
  if (handled_socket < 0) return false;
  pollfd p{handled_socket, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

GatedHttpServer::GatedHttpServer(GateLimits limits) : limits_(limits) {
  epoll_ = epoll_create1(EPOLL_CLOEXEC);
  wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_;
  epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &ev);
}

GatedHttpServer::~GatedHttpServer() {
  stop_gate();
  ::close(wake_);
  ::close(epoll_);
}

void GatedHttpServer::set_gate_limits(const GateLimits& limits) { limits_ = limits; }

void GatedHttpServer::start_threads() {
  gate_ = std::thread([this] { gate_loop(); });
  for (int i = 0; i < std::max(1, limits_.workers); ++i)
    workers_.emplace_back([this] { worker_loop(); });
}

void GatedHttpServer::stop_gate() {
  if (stopping_.exchange(true)) return;
  const uint64_t one = 1;
  (void)!::write(wake_, &one, sizeof one);
  ready_cv_.notify_all();
  if (gate_.joinable()) gate_.join();
  for (std::thread& w : workers_) w.join();
  workers_.clear();
  std::lock_guard<std::mutex> lk(mu_);
  for (socket_t s : ready_) close_socket(s);
  for (auto& [s, idle] : incoming_) close_socket(s);
  ready_.clear();
  incoming_.clear();
}

// Called by httplib's accept loop for each new connection: the gate takes it, no thread waits.
bool GatedHttpServer::process_and_close_socket(socket_t sock) {
  std::call_once(started_, [this] { start_threads(); });
  if (stopping_) {
    close_socket(sock);
    return false;
  }
  admit(sock, false);
  return true;
}

void GatedHttpServer::admit(socket_t sock, bool idle) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    incoming_.emplace_back(sock, idle);
  }
  const uint64_t one = 1;
  (void)!::write(wake_, &one, sizeof one);
}

void GatedHttpServer::release(socket_t sock, const std::string* answer) {
  epoll_ctl(epoll_, EPOLL_CTL_DEL, sock, nullptr);
  held_.erase(sock);
  if (answer) (void)!::send(sock, answer->data(), answer->size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  close_socket(sock);
}

void GatedHttpServer::shed_one() {
  // The longest-idle keep-alive connection, else the request slowest to send its headers.
  auto victim = held_.end();
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (victim == held_.end() || (it->second.idle && !victim->second.idle) ||
        (it->second.idle == victim->second.idle && it->second.admitted < victim->second.admitted))
      victim = it;
  }
  if (victim != held_.end()) release(victim->first, victim->second.idle ? nullptr : &kBusyReply);
}

void GatedHttpServer::check_ready(socket_t sock) {
  auto it = held_.find(sock);
  if (it == held_.end()) return;
  static thread_local char peek[kMaxGatedHeaderBytes + kGatedBodyBytes];
  const ssize_t n = ::recv(sock, peek, sizeof peek, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return release(sock, nullptr);  // the client closed
  if (n < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) release(sock, nullptr);
    return;
  }
  Held& h = it->second;
  if (h.idle) {  // the next request begins: its headers' clock starts now
    h.idle = false;
    h.deadline = Clock::now() + std::chrono::seconds(limits_.header_seconds);
  }
  const std::string_view got(peek, size_t(n));
  const size_t end = got.find("\r\n\r\n");
  if (end == std::string_view::npos || end > kMaxGatedHeaderBytes) {
    if (got.size() >= kMaxGatedHeaderBytes) release(sock, &kTooLargeReply);
    return;  // more to come, within the deadline
  }
  // A small body is waited for here too, so a slow sender of one holds no worker.
  const size_t want = end + 4 + std::min(content_length(got.substr(0, end + 2)), kGatedBodyBytes);
  if (got.size() < want) return;
  epoll_ctl(epoll_, EPOLL_CTL_DEL, sock, nullptr);
  held_.erase(it);
  {
    std::lock_guard<std::mutex> lk(mu_);
    ready_.push_back(sock);
  }
  ++busy_;
  ready_cv_.notify_one();
}

void GatedHttpServer::gate_loop() {
  std::vector<epoll_event> events(256);
  std::deque<std::pair<socket_t, bool>> admitted;
  while (!stopping_) {
    const int n = epoll_wait(epoll_, events.data(), int(events.size()), 100);
    {
      std::lock_guard<std::mutex> lk(mu_);
      admitted.swap(incoming_);
    }
    const auto now = Clock::now();
    for (auto [sock, idle] : admitted) {
      if (held_.size() + busy_ >= limits_.max_connections) shed_one();
      if (held_.size() + busy_ >= limits_.max_connections) {  // every connection is being served
        (void)!::send(sock, kBusyReply.data(), kBusyReply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        close_socket(sock);
        continue;
      }
      held_[sock] = {
          now + std::chrono::seconds(idle ? limits_.idle_seconds : limits_.header_seconds),
          ++admissions_, idle};
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
      ev.data.fd = sock;
      if (epoll_ctl(epoll_, EPOLL_CTL_ADD, sock, &ev) != 0) release(sock, nullptr);
    }
    admitted.clear();
    for (int i = 0; i < n; ++i) {
      if (events[size_t(i)].data.fd == wake_) {
        uint64_t count;
        (void)!::read(wake_, &count, sizeof count);
        continue;
      }
      check_ready(events[size_t(i)].data.fd);
    }
    std::vector<std::pair<socket_t, bool>> expired;
    for (const auto& [sock, h] : held_)
      if (now > h.deadline) expired.emplace_back(sock, h.idle);
    for (auto [sock, idle] : expired) release(sock, idle ? nullptr : &kTimeoutReply);
  }
  std::vector<socket_t> all;
  for (const auto& [sock, h] : held_) all.push_back(sock);
  for (socket_t s : all) release(s, nullptr);
}

void GatedHttpServer::worker_loop() {
  for (;;) {
    socket_t sock;
    {
      std::unique_lock<std::mutex> lk(mu_);
      ready_cv_.wait(lk, [this] { return stopping_ || !ready_.empty(); });
      if (ready_.empty()) return;
      sock = ready_.front();
      ready_.pop_front();
    }
    FdStream strm(sock, limits_.io_seconds * 1000);
    handled_socket = sock;
    bool keep = true;
    do {  // again while a pipelined request sits in the stream's buffer
      bool closed = false;
      close_requested = false;
      keep = process_request(strm, /*close_connection=*/stopping_.load(), closed, nullptr) &&
             !closed && !close_requested && !stopping_;
    } while (keep && strm.has_buffered());
    handled_socket = -1;
    --busy_;
    if (keep)
      admit(sock, true);  // back to the gate until its next request arrives
    else
      close_socket(sock);
  }
}

}  // namespace r3::server
