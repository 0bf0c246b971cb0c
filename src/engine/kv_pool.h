// The KV block manager (metadata only; the KV values live in KvCache). Fixed-size blocks with
// ref counts, chained hashes of full blocks for prefix caching, an LRU free list in which freed
// blocks keep their hash until reused, and a generation counter per block that increases every
// time the block is handed out for new content (routes are valid only for the generation they
// were written under: DESIGN.md "Route validity = KV validity").
#pragma once
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace r3 {

class KvPool {
 public:
  KvPool(int num_blocks, int block_size);

  int block_size() const { return block_size_; }
  int num_blocks() const { return num_blocks_; }
  int num_free() const { return num_free_; }
  uint64_t generation(int block) const { return blocks_[size_t(block)].generation; }
  int ref_count(int block) const { return blocks_[size_t(block)].ref; }

  // A block for new content: the least recently freed one; its old hash is dropped and its
  // generation increases. Returns -1 when none is free.
  int allocate();
  // Takes another reference on a cached block (a prefix hit); revives it from the free list.
  void acquire(int block);
  // Drops a reference; at zero the block joins the free list's tail, keeping its hash.
  void release(int block);

  // Chained hash of a full block: hash(parent, tokens).
  static uint64_t chain_hash(uint64_t parent, const int* tokens, int n);
  // The parent of a sequence's first block: the weight version its KV is computed under, so a
  // block computed under one version is never a prefix hit under another (whatever a refit's
  // flush_cache said), and every token's version label stays true.
  static uint64_t chain_root(uint64_t weight_version);
  // Publishes a full block under its chained hash (first writer wins). tokens are kept to
  // check hits against hash collisions.
  void publish(int block, uint64_t hash, const int* tokens);
  // The longest run of cached full blocks for `tokens`, never covering the last token (a prefix
  // hit must leave at least one token to compute). Does not take references.
  std::vector<int> lookup_prefix(const std::vector<int>& tokens, uint64_t root = 0) const;
  // The cached block published under `hash` holding `tokens` (block_size of them), or -1.
  int find(uint64_t hash, const int* tokens) const;
  // Forgets every published hash (weight refit): no later lookup can hit old KV.
  void flush();

  // Counters for stats and tests.
  uint64_t hashed_blocks() const { return by_hash_.size(); }
  uint64_t publishes() const { return publishes_; }

 private:
  struct Block {
    int ref = 0;
    uint64_t generation = 0;
    bool hashed = false;
    uint64_t hash = 0;
    std::vector<int> tokens;
    int prev = -1, next = -1;  // free list links
    bool in_free_list = false;
  };
  void unlink(int b);
  void push_tail(int b);
  void unpublish(int b);

  int num_blocks_, block_size_;
  std::vector<Block> blocks_;
  int head_ = -1, tail_ = -1, num_free_ = 0;
  std::unordered_map<uint64_t, int> by_hash_;  // one heap node per published block
  uint64_t publishes_ = 0;
};

}  // namespace r3
