#include "parallel/mpi_expert_group.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"
#include "core/resident_memory.h"
#include "engine/engine.h"
#include "engine/engine_config_json.h"
#include "step/step_wire.h"

namespace r3 {

namespace {

constexpr int kRowsTag = 1, kStatusTag = 2, kResidentTag = 3;
// A new engine reads its checkpoint (up to kCheckpointReadLimit) before the handshake.
constexpr double kStartTimeoutS = 900;
// A command's bytes follow its header at once.
constexpr double kBodyTimeoutS = 60;

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int n = 0;
  MPI_Error_string(rc, text, &n);
  return std::string(text, size_t(n));
}

}  // namespace

// One engine's exchange, on any rank.
class MpiExchange : public ExpertExchange {
 public:
  MpiExchange(MpiExpertGroup* group, uint64_t engine, double timeout_s)
      : group_(group), engine_(engine), timeout_s_(timeout_s) {}
  ~MpiExchange() override {
    try {
      if (group_->broken_) return;
      if (!handshook_)
        group_->handshake(false, kStartTimeoutS);  // this rank's engine failed to build
      else if (group_->rank_ == 0 && started_)
        group_->broadcast(MpiExpertGroup::kEndEngine, engine_, nullptr, 0, timeout_s_);
    } catch (...) {
    }
  }
  int rank() const override { return group_->rank_; }
  int ranks() const override { return group_->ranks_; }
  void started(bool ok) override {
    handshook_ = true;
    if (!group_->handshake(ok, kStartTimeoutS))
      throw Error("expert parallelism: another rank could not build its engine (its log says why)");
    started_ = true;
  }
  void send_step(const StepPlan& plan, const int* token_ids) override {
    write_step(plan, token_ids, bytes_);
    step_ = plan.iter;
    group_->broadcast(MpiExpertGroup::kStep, engine_, bytes_.data(), bytes_.size(), timeout_s_);
  }
  void note_step(uint64_t iter) { step_ = iter; }
  void set_timeout(double s) { timeout_s_ = s; }
  void gather_expert_rows(float* rows, const int* offsets, int num_physical, int width) override {
    begin_.resize(size_t(group_->ranks_) + 1);
    for (int r = 0; r <= group_->ranks_; ++r)
      begin_[size_t(r)] = int64_t(offsets[first_physical(r, group_->ranks_, num_physical)]) * width;
    group_->exchange_rows(rows, begin_, timeout_s_, step_);
  }
  std::vector<double> resident_mb_by_rank() override {
    return group_->resident_by_rank(timeout_s_);
  }

 private:
  MpiExpertGroup* group_;
  uint64_t engine_;
  double timeout_s_;
  bool handshook_ = false, started_ = false;
  uint64_t step_ = 0;
  std::vector<uint8_t> bytes_;
  std::vector<int64_t> begin_;
};

MpiExpertGroup::MpiExpertGroup(int* argc, char*** argv) {
  int provided = 0;
  if (const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
      rc != MPI_SUCCESS)
    throw Error("MPI_Init_thread: " + mpi_error_text(rc));
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks_);
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    throw Error(
        "this MPI library does not allow calls from more than one thread (MPI_THREAD_SERIALIZED)");
  }
}

MpiExpertGroup::~MpiExpertGroup() {
  if (broken_) {
    std::fprintf(stderr, "r3 rank %d: the expert-parallel group is broken (%s): aborting the job\n",
                 rank_, broken_why_.c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  try {
    if (rank_ == 0 && ranks_ > 1 && !dissolved_) broadcast(kExit, 0, nullptr, 0, kBodyTimeoutS);
  } catch (...) {
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
}

void MpiExpertGroup::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_) broken_why_ = why;
  }
  broken_ = true;
  std::fprintf(stderr, "r3 rank %d: %s\n", rank_, why.c_str());
  throw Error("expert parallelism failed: " + why);
}

void MpiExpertGroup::check_mpi(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS)
    fail(what + ": " + mpi_error_text(rc));  // the ranks' call orders may now differ
}

void MpiExpertGroup::check_usable() const {
  if (!broken_) return;
  std::lock_guard<std::mutex> lock(mu_);
  throw Error("expert parallelism failed earlier: " + broken_why_);
}

std::string MpiExpertGroup::who(int rank) const {
  if (rank != kAnyFollower) return "rank " + std::to_string(rank);
  return ranks_ == 2 ? "rank 1" : "one of ranks 1-" + std::to_string(ranks_ - 1);
}

void MpiExpertGroup::abandon(MPI_Request* requests, int n, bool point_to_point) {
  // A rank that stopped and resumes must not write into buffers freed since: point-to-point
  // requests are cancelled and freed. (Collectives cannot be cancelled; rank 0 is their root, so
  // its pending ones only read.)
  if (!point_to_point) return;
  for (int i = 0; i < n; ++i)
    if (requests[i] != MPI_REQUEST_NULL) {
      MPI_Cancel(&requests[i]);
      MPI_Request_free(&requests[i]);
    }
}

void MpiExpertGroup::wait_all(MPI_Request* requests, const int* from, int n, double timeout_s,
                              const std::string& what, bool point_to_point, bool idle) {
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (int i = 0; i < n; ++i) {
    for (int polls = 0;; ++polls) {
      int done = 0;
      const int rc = MPI_Test(&requests[i], &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        abandon(requests + i, n - i, point_to_point);
        fail(what + ": MPI error with " + who(from[i]) + ": " + mpi_error_text(rc));
      }
      if (done) break;
      const auto now = Clock::now();
      if (!idle && now > deadline) {
        abandon(requests + i, n - i, point_to_point);
        fail(who(from[i]) + " did not answer within " + std::to_string(int(timeout_s)) + " s (" +
             what + ")");
      }
      // Idle (a follower waiting for rank 0's next command): poll hot while steps come back to
      // back, then sleep between polls so an idle group leaves the cores alone.
      if (idle && now - last_message_ > std::chrono::milliseconds(50))
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

void MpiExpertGroup::broadcast(Command c, uint64_t engine, const void* bytes, size_t n,
                               double timeout_s) {
  check_usable();
  Header h;
  h.command = c;
  h.engine = engine;
  h.bytes = n;
  if (n > size_t(INT32_MAX))
    throw Error("expert parallelism: a step message over 2 GiB");  // before any rank hears of it
  MPI_Request req[2];
  const int root[2] = {kAnyFollower, kAnyFollower};  // a broadcast does not say who held it up
  header_ = h;                                       // outlives a broadcast abandoned on a timeout
  check_mpi(MPI_Ibcast(&header_, int(sizeof header_), MPI_BYTE, 0, MPI_COMM_WORLD, &req[0]),
            "MPI_Ibcast");
  int parts = 1;
  if (n > 0)
    check_mpi(
        MPI_Ibcast(const_cast<void*>(bytes), int(n), MPI_BYTE, 0, MPI_COMM_WORLD, &req[parts++]),
        "MPI_Ibcast");
  wait_all(req, root, parts, timeout_s, "sending a command to every rank", false);
}

MpiExpertGroup::Header MpiExpertGroup::receive(std::vector<uint8_t>& bytes) {
  Header h;
  MPI_Request req;
  const int root = 0;
  check_mpi(MPI_Ibcast(&h, int(sizeof h), MPI_BYTE, 0, MPI_COMM_WORLD, &req), "MPI_Ibcast");
  wait_all(&req, &root, 1, 0, "waiting for rank 0", false, /*idle=*/true);
  bytes.resize(size_t(h.bytes));
  if (h.bytes > 0) {
    check_mpi(MPI_Ibcast(bytes.data(), int(h.bytes), MPI_BYTE, 0, MPI_COMM_WORLD, &req),
              "MPI_Ibcast");
    wait_all(&req, &root, 1, kBodyTimeoutS, "receiving a command from rank 0", false);
  }
  last_message_ = Clock::now();
  return h;
}

void MpiExpertGroup::receive_from_followers(void* values, MPI_Datatype type, int tag,
                                            double timeout_s, const std::string& what) {
  int size = 0;
  MPI_Type_size(type, &size);
  std::vector<MPI_Request> req(size_t(ranks_) - 1);
  std::vector<int> from(size_t(ranks_) - 1);
  for (int r = 1; r < ranks_; ++r) {
    from[size_t(r - 1)] = r;
    check_mpi(MPI_Irecv(static_cast<char*>(values) + size_t(r) * size_t(size), 1, type, r, tag,
                        MPI_COMM_WORLD, &req[size_t(r - 1)]),
              "MPI_Irecv");
  }
  wait_all(req.data(), from.data(), ranks_ - 1, timeout_s, what, true);
}

bool MpiExpertGroup::handshake(bool ok, double timeout_s) {
  check_usable();
  verdict_ = ok;  // members: they outlive requests abandoned on a timeout
  int& verdict = verdict_;
  if (rank_ == 0) {
    std::vector<int>& status = status_;
    status.assign(size_t(ranks_), 0);
    receive_from_followers(status.data(), MPI_INT, kStatusTag, timeout_s, "building the engine");
    for (int r = 1; r < ranks_; ++r)
      if (!status[size_t(r)]) {
        std::fprintf(stderr, "r3 rank 0: rank %d could not build its engine (its log says why)\n",
                     r);
        verdict = 0;
      }
    MPI_Request b;
    const int none = kAnyFollower;
    check_mpi(MPI_Ibcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD, &b), "MPI_Ibcast");
    wait_all(&b, &none, 1, timeout_s, "starting the engine", false);
  } else {
    MPI_Request req[2];
    const int zero[2] = {0, 0};
    mine_ = ok;
    check_mpi(MPI_Isend(&mine_, 1, MPI_INT, 0, kStatusTag, MPI_COMM_WORLD, &req[0]), "MPI_Isend");
    check_mpi(MPI_Ibcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD, &req[1]), "MPI_Ibcast");
    wait_all(req, zero, 2, timeout_s, "starting the engine", false);
  }
  return verdict != 0;
}

void MpiExpertGroup::exchange_rows(float* rows, const std::vector<int64_t>& begin, double timeout_s,
                                   uint64_t step) {
  check_usable();
  const int me = rank_;
  std::vector<MPI_Request> req;
  std::vector<int> from;
  req.reserve(size_t(2 * ranks_));
  for (int r = 0; r < ranks_; ++r) {  // receives first: a missing rank is named by its rows
    if (r == me) continue;
    const int64_t n = begin[size_t(r + 1)] - begin[size_t(r)];
    if (n > INT32_MAX) throw Error("expert parallelism: one rank's expert rows exceed 2^31 floats");
    req.emplace_back();
    from.push_back(r);
    check_mpi(MPI_Irecv(rows + begin[size_t(r)], int(n), MPI_FLOAT, r, kRowsTag, MPI_COMM_WORLD,
                        &req.back()),
              "MPI_Irecv");
  }
  const int64_t mine = begin[size_t(me + 1)] - begin[size_t(me)];
  for (int r = 0; r < ranks_; ++r) {
    if (r == me) continue;
    req.emplace_back();
    from.push_back(r);
    check_mpi(MPI_Isend(rows + begin[size_t(me)], int(mine), MPI_FLOAT, r, kRowsTag, MPI_COMM_WORLD,
                        &req.back()),
              "MPI_Isend");
  }
  wait_all(req.data(), from.data(), int(req.size()), timeout_s,
           "expert rows of step " + std::to_string(step), true);
}

std::vector<double> MpiExpertGroup::resident_by_rank(double timeout_s) {
  broadcast(kResident, 0, nullptr, 0, timeout_s);
  std::vector<double>& mb = resident_;
  mb.assign(size_t(ranks_), 0.0);
  mb[0] = resident_mb();
  receive_from_followers(mb.data(), MPI_DOUBLE, kResidentTag, timeout_s, "resident memory");
  return mb;
}

std::unique_ptr<ExpertExchange> MpiExpertGroup::open(int ranks, double timeout_s,
                                                     const std::string& config_json) {
  if (rank_ != 0) throw Error("only rank 0 opens engines");
  if (ranks != ranks_)
    throw Error("expert_parallel " + std::to_string(ranks) + " but mpirun started " +
                std::to_string(ranks_) + " ranks");
  const uint64_t id = next_engine_++;
  broadcast(kNewEngine, id, config_json.data(), config_json.size(), timeout_s);
  return std::make_unique<MpiExchange>(this, id, timeout_s);
}

int MpiExpertGroup::serve() {
  std::fprintf(stderr, "r3 rank %d of %d (pid %d): computing experts for rank 0\n", rank_, ranks_,
               int(getpid()));
  struct Served {
    std::unique_ptr<Engine> engine;
    MpiExchange* exchange;  // owned by the engine
  };
  std::map<uint64_t, Served> engines;
  std::vector<uint8_t> bytes;
  StepPlan plan;
  std::vector<int> token_ids;
  try {
    for (;;) {
      const Header h = receive(bytes);
      switch (h.command) {
        case kNewEngine: {
          // Whatever fails below, the exchange's destructor tells rank 0 (the handshake).
          auto exchange = std::make_unique<MpiExchange>(this, h.engine, kBodyTimeoutS);
          MpiExchange* x = exchange.get();
          try {
            EngineConfig cfg = engine_config_from_json(std::string(bytes.begin(), bytes.end()));
            cfg.enable_return_routed_experts = false;  // rank 0 captures routes
            cfg.overlap_scheduler = false;             // steps come from rank 0, one at a time
            x->set_timeout(cfg.expert_timeout_s);
            engines[h.engine] = {std::make_unique<Engine>(cfg, std::move(exchange)), x};
            std::fprintf(stderr, "r3 rank %d: engine %llu built, resident memory %.0f MB\n", rank_,
                         (unsigned long long)h.engine, resident_mb());
          } catch (const Error& e) {
            if (broken_) throw;
            std::fprintf(stderr, "r3 rank %d: engine %llu: %s\n", rank_,
                         (unsigned long long)h.engine, e.what());
          }
          break;
        }
        case kStep: {
          read_step(bytes, plan, token_ids);
          auto it = engines.find(h.engine);
          if (it == engines.end())
            throw Error("a step for engine " + std::to_string(h.engine) +
                        ", which this rank does not hold");
          it->second.exchange->note_step(plan.iter);
          it->second.engine->compute_step(plan, token_ids.data());
          break;
        }
        case kEndEngine:
          engines.erase(h.engine);
          break;
        case kResident: {
          const double mb = resident_mb();
          MPI_Request req;
          const int zero = 0;
          check_mpi(MPI_Isend(&mb, 1, MPI_DOUBLE, 0, kResidentTag, MPI_COMM_WORLD, &req),
                    "MPI_Isend");
          wait_all(&req, &zero, 1, kBodyTimeoutS, "resident memory", true);
          break;
        }
        case kExit:
          engines.clear();
          return 0;
        default:
          throw Error("unknown command " + std::to_string(h.command) + " from rank 0");
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "r3 rank %d: %s: leaving the job\n", rank_, e.what());
    std::fflush(stderr);
    std::_Exit(1);  // no finalize: the ranks it would wait for may be gone
  }
}

}  // namespace r3
