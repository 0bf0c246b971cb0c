#include "engine/kv_pool.h"

#include <algorithm>

#include "core/error.h"
#include "core/rng.h"

namespace r3 {

KvPool::KvPool(int num_blocks, int block_size)
    : num_blocks_(num_blocks), block_size_(block_size), blocks_(size_t(num_blocks)) {
  if (num_blocks <= 0 || block_size <= 0)
    throw Error("KV pool needs positive num_blocks and block_size");
  for (int b = 0; b < num_blocks; ++b) {
    push_tail(b);
    blocks_[size_t(b)].tokens.reserve(size_t(block_size));
  }
  by_hash_.reserve(size_t(num_blocks));
}

void KvPool::unlink(int b) {
  Block& k = blocks_[size_t(b)];
  if (k.prev >= 0)
    blocks_[size_t(k.prev)].next = k.next;
  else
    head_ = k.next;
  if (k.next >= 0)
    blocks_[size_t(k.next)].prev = k.prev;
  else
    tail_ = k.prev;
  k.prev = k.next = -1;
  k.in_free_list = false;
  --num_free_;
}

void KvPool::push_tail(int b) {
  Block& k = blocks_[size_t(b)];
  k.prev = tail_;
  k.next = -1;
  if (tail_ >= 0)
    blocks_[size_t(tail_)].next = b;
  else
    head_ = b;
  tail_ = b;
  k.in_free_list = true;
  ++num_free_;
}

void KvPool::unpublish(int b) {
  Block& k = blocks_[size_t(b)];
  if (!k.hashed) return;
  auto it = by_hash_.find(k.hash);
  if (it != by_hash_.end() && it->second == b) by_hash_.erase(it);
  k.hashed = false;
  k.tokens.clear();
}

int KvPool::allocate() {
  if (head_ < 0) return -1;
  int b = head_;
  unlink(b);
  unpublish(b);
  Block& k = blocks_[size_t(b)];
  k.ref = 1;
  ++k.generation;
  return b;
}

void KvPool::acquire(int b) {
  Block& k = blocks_[size_t(b)];
  if (k.in_free_list) unlink(b);
  ++k.ref;
}

void KvPool::release(int b) {
  Block& k = blocks_[size_t(b)];
  if (k.ref <= 0) throw Error("KvPool: release of a free block");
  if (--k.ref == 0) push_tail(b);
}

uint64_t KvPool::chain_hash(uint64_t parent, const int* tokens, int n) {
  uint64_t h = splitmix64(parent ^ 0x5253524f55544553ull);
  for (int i = 0; i < n; ++i) h = hash_pair(h, uint64_t(uint32_t(tokens[i])));
  return h;
}

void KvPool::publish(int b, uint64_t hash, const int* tokens) {
  Block& k = blocks_[size_t(b)];
  if (k.hashed || by_hash_.count(hash)) return;
  k.hashed = true;
  k.hash = hash;
  k.tokens.assign(tokens, tokens + block_size_);
  by_hash_[hash] = b;
  ++publishes_;
}

int KvPool::find(uint64_t hash, const int* tokens) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return -1;
  const Block& k = blocks_[size_t(it->second)];
  return std::equal(tokens, tokens + block_size_, k.tokens.begin()) ? it->second
                                                                    : -1;  // else a collision
}

uint64_t KvPool::chain_root(uint64_t weight_version) {
  return weight_version == 0 ? 0 : splitmix64(weight_version ^ 0x5745494748545321ull);
}

std::vector<int> KvPool::lookup_prefix(const std::vector<int>& tokens, uint64_t root) const {
  std::vector<int> hit;
  const int full = (int(tokens.size()) - 1) / block_size_;  // never the last token
  uint64_t h = root;
  for (int i = 0; i < full; ++i) {
    const int* t = tokens.data() + size_t(i) * block_size_;
    h = chain_hash(h, t, block_size_);
    const int b = find(h, t);
    if (b < 0) break;
    hit.push_back(b);
  }
  return hit;
}

void KvPool::flush() {
  for (int b = 0; b < num_blocks_; ++b) unpublish(b);
  by_hash_.clear();
}

}  // namespace r3
