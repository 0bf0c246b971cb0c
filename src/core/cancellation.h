// Long work a request runs on its own thread (tokenizing a large text, rendering a chat template)
// stops early when the request no longer matters: its client left, or the server is stopping.
// Whoever owns the thread says what "cancelled" means with a CancellationScope for the request;
// the work calls throw_if_cancelled() every so often (it costs one thread-local read outside a
// scope, and the owner's check inside). Scopes nest; the innermost is asked.
#pragma once
#include <functional>
#include <string_view>

namespace r3 {

class CancellationScope {
 public:
  explicit CancellationScope(std::function<bool()> cancelled);
  ~CancellationScope();
  CancellationScope(const CancellationScope&) = delete;
  CancellationScope& operator=(const CancellationScope&) = delete;

 private:
  std::function<bool()> cancelled_;
  CancellationScope* previous_;
  friend bool cancellation_requested();
};

// Whether the innermost scope on this thread says its work is cancelled (false outside one).
bool cancellation_requested();
// r3::Error("<what> was cancelled: the request's client left or the server is stopping") when
// cancellation_requested().
void throw_if_cancelled(std::string_view what);

}  // namespace r3
