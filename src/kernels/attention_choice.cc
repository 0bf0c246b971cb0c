#include "kernels/attention_choice.h"

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "core/big_alloc.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/attention.h"
#include "kernels/machine_cache.h"

namespace r3::kernels {

namespace {
std::atomic<DecodeAttention> g_loop{DecodeAttention::Heads};

// The timing's workload: `seqs` tokens, each over kKeys keys of 16 kv heads of 64, in a bf16
// cache of blocks of 16 scattered over the pool: 8 MiB a token, at least 64 MiB and twice the
// last-level cache (a VM may report a shared L3 of hundreds of MiB; a cache that fits in it times
// the L3, not the memory the engine's KV streams from), and at least 2 tokens a thread.
constexpr int kKeys = 2048, kBlock = 16, kHeads = 16, kDim = 64;
constexpr int kBlocksPerSeq = kKeys / kBlock;
constexpr int64_t kKvDim = int64_t(kHeads) * kDim, kBlockElems = kKvDim * kBlock;
int timing_seqs(int threads) {
  constexpr int64_t kSeqBytes = int64_t(2) * kBlocksPerSeq * kBlockElems * 2;
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  const int64_t bytes =
      std::clamp<int64_t>(2 * int64_t(std::max(0L, l3)), int64_t(64) << 20, int64_t(2) << 30);
  return std::max(int(bytes / kSeqBytes), 2 * threads);
}

struct TimingCache {
  explicit TimingCache(ThreadPool* pool) : pool(pool), seqs(timing_seqs(pool->size())) { fill(); }
  ThreadPool* pool;
  int seqs;
  int blocks() const { return seqs * kBlocksPerSeq; }
  BigArray<uint16_t> k{size_t(blocks()) * kBlockElems}, v{size_t(blocks()) * kBlockElems};
  std::vector<int> tables;
  std::vector<float> q;
  void fill() {
    const int n_blocks = blocks();
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    pool->parallel_for(n_blocks, [&](int64_t b0, int64_t b1) {
      for (size_t i = size_t(b0) * kBlockElems; i < size_t(b1) * kBlockElems;
           ++i) {  // cheap values in [-0.5, 0.5)
        const float x = float(uint32_t(i * 2654435761u) >> 8) * 0x1p-24f - 0.5f;
        k.get()[i] = v.get()[i] = f32_to_bf16(x);
      }
    });
    tables.resize(size_t(n_blocks));
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);  // scattered, as a served pool's blocks are
    q.resize(size_t(seqs) * kHeads * kDim);
    for (float& x : q) x = u(rng);
  }
};

// KV bytes per second of every thread of the pool running `loop` over its share of the
// sequences, as the engine runs a decode step: the loops differ in how many misses one thread
// keeps in flight, and how that adds up over the cores is what the engine gets (one thread alone
// ranked them the other way round on a Xeon).
double time_loop(const TimingCache& c, DecodeAttention loop) {
  const TimingCache* cache = &c;
  const float scale = 0.125f;
  const auto t0 = std::chrono::steady_clock::now();
  c.pool->parallel_for(c.seqs, [&](int64_t s0, int64_t s1) {
    // Each thread's scratch outlives the timed call, so no timing pays for its allocation.
    thread_local std::vector<float> scores(size_t(kHeads) * kKeys), out(size_t(kHeads) * kDim);
    for (int64_t s = s0; s < s1; ++s) {
      PagedHead<uint16_t> kv{
          cache->k.get(), cache->v.get(), cache->tables.data() + size_t(s) * kBlocksPerSeq,
          kBlock,         kKvDim,         0};
      const float* q = cache->q.data() + size_t(s) * kHeads * kDim;
      if (loop == DecodeAttention::Heads) {
        attend_heads(q, 0, kHeads, 1, kDim, kKeys - 1, scale, kv, nullptr, scores.data(), kKeys,
                     out.data());
      } else {
        for (int h = 0; h < kHeads; ++h) {
          kv.head_offset = int64_t(h) * kDim;
          attend(q + size_t(h) * kDim, kDim, kKeys - 1, scale, kv, scores.data(),
                 out.data() + size_t(h) * kDim);
        }
      }
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * double(c.blocks()) * double(kBlockElems) * 2 / seconds / 1e9;
}
}  // namespace

const char* decode_attention_name(DecodeAttention a) {
  return a == DecodeAttention::PerHead ? "per_head" : "heads";
}
DecodeAttention decode_attention() { return g_loop.load(std::memory_order_relaxed); }
void set_decode_attention(DecodeAttention a) { g_loop.store(a, std::memory_order_relaxed); }

AttentionChoice choose_decode_attention(const std::string& cache_file, const char* forced) {
  AttentionChoice c;
  const MachineChoice m =
      choose_on_machine(cache_file, "R3_ATTENTION", forced, {"heads", "per_head"}, [&] {
        ThreadPool pool(int(std::max(1u, std::thread::hardware_concurrency())));
        const TimingCache cache(&pool);
        time_loop(cache, DecodeAttention::Heads);  // warm-up: the pages and the code
        // Interleaved rounds, each loop going first in turn (the second run of a pair measured
        // faster whichever it was); the best of each.
        for (int round = 0; round < 6; ++round)
          for (int i = 0; i < 2; ++i)
            if ((round + i) % 2 == 0)
              c.heads_gb_per_s =
                  std::max(c.heads_gb_per_s, time_loop(cache, DecodeAttention::Heads));
            else
              c.per_head_gb_per_s =
                  std::max(c.per_head_gb_per_s, time_loop(cache, DecodeAttention::PerHead));
        return c.per_head_gb_per_s > 1.05 * c.heads_gb_per_s ? "per_head" : "heads";
      });
  c.loop = m.name == "per_head" ? DecodeAttention::PerHead : DecodeAttention::Heads;
  c.source = m.source;
  set_decode_attention(c.loop);
  return c;
}

const AttentionChoice& tuned_decode_attention() {
  static const AttentionChoice choice =
      choose_decode_attention(machine_cache_file("decode_attention"), std::getenv("R3_ATTENTION"));
  return choice;
}

}  // namespace r3::kernels
