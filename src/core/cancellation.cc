#include "core/cancellation.h"

#include <string>

#include "core/error.h"

namespace r3 {

namespace {
thread_local CancellationScope* innermost = nullptr;
}  // namespace

CancellationScope::CancellationScope(std::function<bool()> cancelled)
    : cancelled_(std::move(cancelled)), previous_(innermost) {
  innermost = this;
}

CancellationScope::~CancellationScope() { innermost = previous_; }

bool cancellation_requested() {
  return innermost && innermost->cancelled_ && innermost->cancelled_();
}

void throw_if_cancelled(std::string_view what) {
  if (cancellation_requested())
    throw Error(std::string(what) +
                " was cancelled: the request's client left or the server is stopping");
}

}  // namespace r3
