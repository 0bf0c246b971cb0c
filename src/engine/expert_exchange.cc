#include "engine/expert_exchange.h"

namespace r3 {

namespace {
ExpertExchangeOpener& opener_storage() {
  static ExpertExchangeOpener opener;
  return opener;
}
}  // namespace

void set_expert_exchange_opener(ExpertExchangeOpener opener) { opener_storage() = std::move(opener); }
const ExpertExchangeOpener& expert_exchange_opener() { return opener_storage(); }

}  // namespace r3
