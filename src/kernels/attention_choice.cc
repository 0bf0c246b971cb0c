#include "kernels/attention_choice.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "core/big_alloc.h"
#include "core/dtype.h"
#include "kernels/attention.h"
#include "kernels/machine_cache.h"

namespace r3::kernels {

namespace {
std::atomic<DecodeAttention> g_loop{DecodeAttention::Heads};

// The timing's workload: kSeqs tokens, each over kKeys keys of 16 kv heads of 64, in a bf16 cache
// of blocks of 16 scattered over the pool (64 MiB: past any last-level cache).
constexpr int kSeqs = 8, kKeys = 2048, kBlock = 16, kHeads = 16, kDim = 64;
constexpr int kBlocksPerSeq = kKeys / kBlock, kBlocks = kSeqs * kBlocksPerSeq;
constexpr int64_t kKvDim = int64_t(kHeads) * kDim, kBlockElems = kKvDim * kBlock;
struct TimingCache {
  BigArray<uint16_t> k{size_t(kBlocks) * kBlockElems}, v{size_t(kBlocks) * kBlockElems};
  std::vector<int> tables;
  std::vector<float> q;
  TimingCache() {
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (size_t i = 0; i < size_t(kBlocks) * kBlockElems; ++i) {  // cheap values in [-0.5, 0.5)
      const float x = float(uint32_t(i * 2654435761u) >> 8) * 0x1p-24f - 0.5f;
      k.get()[i] = v.get()[i] = f32_to_bf16(x);
    }
    tables.resize(size_t(kBlocks));
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);  // scattered, as a served pool's blocks are
    q.resize(size_t(kSeqs) * kHeads * kDim);
    for (float& x : q) x = u(rng);
  }
};

// KV bytes per second of one thread running `loop` once over the cache.
double time_loop(const TimingCache& c, DecodeAttention loop) {
  const TimingCache* cache = &c;
  std::vector<float> scores(size_t(kHeads) * kKeys), out(size_t(kHeads) * kDim);
  const float scale = 0.125f;
  double best = 1e30;
  {
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < kSeqs; ++s) {
      PagedHead<uint16_t> kv{cache->k.get(), cache->v.get(), cache->tables.data() + size_t(s) * kBlocksPerSeq, kBlock,
                             kKvDim, 0};
      const float* q = cache->q.data() + size_t(s) * kHeads * kDim;
      if (loop == DecodeAttention::Heads) {
        attend_heads(q, 0, kHeads, 1, kDim, kKeys - 1, scale, kv, nullptr, scores.data(), kKeys, out.data());
      } else {
        for (int h = 0; h < kHeads; ++h) {
          kv.head_offset = int64_t(h) * kDim;
          attend(q + size_t(h) * kDim, kDim, kKeys - 1, scale, kv, scores.data(), out.data() + size_t(h) * kDim);
        }
      }
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * double(kBlocks) * double(kBlockElems) * 2 / best / 1e9;
}
}  // namespace

const char* decode_attention_name(DecodeAttention a) { return a == DecodeAttention::PerHead ? "per_head" : "heads"; }
DecodeAttention decode_attention() { return g_loop.load(std::memory_order_relaxed); }
void set_decode_attention(DecodeAttention a) { g_loop.store(a, std::memory_order_relaxed); }

AttentionChoice choose_decode_attention(const std::string& cache_file, const char* forced) {
  AttentionChoice c;
  const MachineChoice m = choose_on_machine(cache_file, "R3_ATTENTION", forced, {"heads", "per_head"}, [&] {
    const TimingCache cache;
    time_loop(cache, DecodeAttention::Heads);  // warm-up: the pages and the code
    // Interleaved rounds, each loop going first in turn (the second run of a pair measured
    // faster whichever it was); the best of each.
    for (int round = 0; round < 6; ++round)
      for (int i = 0; i < 2; ++i)
        if ((round + i) % 2 == 0) c.heads_gb_per_s = std::max(c.heads_gb_per_s, time_loop(cache, DecodeAttention::Heads));
        else c.per_head_gb_per_s = std::max(c.per_head_gb_per_s, time_loop(cache, DecodeAttention::PerHead));
    return c.per_head_gb_per_s > 1.05 * c.heads_gb_per_s ? "per_head" : "heads";
  });
  c.loop = m.name == "per_head" ? DecodeAttention::PerHead : DecodeAttention::Heads;
  c.source = m.source;
  set_decode_attention(c.loop);
  return c;
}

const AttentionChoice& tuned_decode_attention() {
  static const AttentionChoice choice = choose_decode_attention(machine_cache_file("attention"), std::getenv("R3_ATTENTION"));
  return choice;
}

}  // namespace r3::kernels
