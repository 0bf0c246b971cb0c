// The processes of one `mpirun -np N r3 ... --expert-parallel N` job (docs/EXPERT_PARALLEL.md).
// Rank 0 runs the command (server, generate, bench) and opens an ExpertExchange for each engine
// it builds; ranks 1..N-1 serve(): they build the same engines from the config rank 0 sends and
// compute every step it hands them. Rank 0 speaks, the others follow, in one order:
//   new engine (its config JSON) -> started handshake -> steps ... -> end engine ... -> exit.
// Every wait on another rank is polled against a deadline, so a rank that died or stopped
// answering fails the engine with an r3::Error naming the rank instead of hanging it; after that
// the group is broken and every later call fails at once.
// Only the r3 command links MPI (the engine sees engine/expert_exchange.h); MPI is called by one
// thread at a time (MPI_THREAD_SERIALIZED).
#pragma once
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/expert_exchange.h"

namespace r3 {

class MpiExpertGroup {
 public:
  MpiExpertGroup(int* argc, char*** argv);
  // Rank 0: tells the others to exit, then MPI_Finalize (MPI_Abort when the group is broken:
  // a dead rank cannot finalize).
  ~MpiExpertGroup();
  MpiExpertGroup(const MpiExpertGroup&) = delete;
  MpiExpertGroup& operator=(const MpiExpertGroup&) = delete;

  // The ranks part without rank 0 telling the others to exit (they never started serving).
  void dissolve() { dissolved_ = true; }
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  // Ranks 1..N-1: builds and drives engines until rank 0 exits. The process's exit code.
  int serve();
  // Rank 0: a new engine's exchange; the other ranks start building it from config_json.
  std::unique_ptr<ExpertExchange> open(int ranks, double timeout_s, const std::string& config_json);

 private:
  friend class MpiExchange;
  using Clock = std::chrono::steady_clock;
  enum Command : int32_t { kNewEngine = 1, kStep, kEndEngine, kResident, kExit };
  struct Header {
    int32_t command = 0, pad = 0;
    uint64_t engine = 0, bytes = 0;
  };
  // Rank 0: a command and its bytes to every other rank.
  void broadcast(Command c, uint64_t engine, const void* bytes, size_t n, double timeout_s);
  // Ranks 1..N-1: the next command (waiting as long as rank 0 is idle) and its bytes.
  Header receive(std::vector<uint8_t>& bytes);
  // Every rank: whether every rank built engine `id` (rank 0 collects, then tells the others).
  bool handshake(bool ok, double timeout_s);
  // Each rank's block of rows to every other rank (point to point, so a missing rank is named).
  void exchange_rows(float* rows, const std::vector<int64_t>& begin, double timeout_s,
                     uint64_t step);
  std::vector<double> resident_by_rank(double timeout_s);
  // Rank 0: one value of `type` from each rank r >= 1 into values[r] (a member's buffer: the
  // receives may be abandoned pending).
  void receive_from_followers(void* values, MPI_Datatype type, int tag, double timeout_s,
                              const std::string& what);
  // Polls `n` requests until all completed; `from[i]` names the rank request i waits on.
  // Throws r3::Error (and breaks the group) past the deadline or on an MPI error, first
  // cancelling what is left when the requests are point to point.
  void wait_all(MPI_Request* requests, const int* from, int n, double timeout_s,
                const std::string& what, bool point_to_point, bool idle = false);
  void abandon(MPI_Request* requests, int n, bool point_to_point);
  static constexpr int kAnyFollower = -1;  // `from` of rank 0's broadcasts
  std::string who(int rank) const;
  [[noreturn]] void fail(const std::string& why);
  void check_mpi(int rc, const std::string& what);  // fail() unless MPI_SUCCESS
  void check_usable() const;

  int rank_ = 0, ranks_ = 1;
  uint64_t next_engine_ = 1;
  bool dissolved_ = false;
  std::atomic<bool> broken_{false};
  std::string broken_why_;
  mutable std::mutex mu_;  // broken_why_
  Clock::time_point last_message_ = Clock::now();
  // Buffers of requests that may be pending when a wait gives up: members, not locals.
  Header header_;
  int verdict_ = 0, mine_ = 0;
  std::vector<int> status_;
  std::vector<double> resident_;
};

}  // namespace r3
