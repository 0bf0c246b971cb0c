#include "engine/kv_pool.h"

#include <gtest/gtest.h>

namespace r3 {
namespace {

TEST(KvPool, AllocateBumpsGenerationAndRefCounts) {
  KvPool pool(4, 2);
  int a = pool.allocate();
  EXPECT_EQ(pool.ref_count(a), 1);
  const uint64_t g = pool.generation(a);
  pool.release(a);
  EXPECT_EQ(pool.num_free(), 4);
  // LRU: the freed block goes to the tail, so the three never-used blocks come first.
  int b = pool.allocate(), c = pool.allocate(), d = pool.allocate();
  EXPECT_NE(b, a);
  EXPECT_NE(c, a);
  EXPECT_NE(d, a);
  int e = pool.allocate();
  EXPECT_EQ(e, a);
  EXPECT_EQ(pool.generation(a), g + 1);
  EXPECT_EQ(pool.allocate(), -1);
}

TEST(KvPool, FreedBlocksKeepTheirHashUntilReused) {
  KvPool pool(3, 2);
  std::vector<int> toks = {5, 6, 7, 8, 9};
  int a = pool.allocate(), b = pool.allocate();
  uint64_t h0 = KvPool::chain_hash(0, toks.data(), 2);
  uint64_t h1 = KvPool::chain_hash(h0, toks.data() + 2, 2);
  pool.publish(a, h0, toks.data());
  pool.publish(b, h1, toks.data() + 2);
  pool.release(a);
  pool.release(b);
  auto hit = pool.lookup_prefix(toks);  // 5 tokens: 2 full blocks, last token not covered
  ASSERT_EQ(hit.size(), 2u);
  EXPECT_EQ(hit[0], a);
  EXPECT_EQ(hit[1], b);
  // A prompt of exactly 4 tokens: the second block would cover the last token.
  EXPECT_EQ(pool.lookup_prefix({5, 6, 7, 8}).size(), 1u);
  pool.acquire(a);
  EXPECT_EQ(pool.ref_count(a), 1);
  pool.release(a);
  // Free list is now [never-used, b, a] (a was revived and freed again, so it is newest).
  int c = pool.allocate();
  EXPECT_NE(c, a);
  EXPECT_NE(c, b);
  int d = pool.allocate();
  EXPECT_EQ(d, b);                                 // least recently freed goes first
  EXPECT_EQ(pool.lookup_prefix(toks).size(), 1u);  // b's hash was dropped on reuse, a's kept
}

TEST(KvPool, HashCollisionIsCheckedAgainstTokens) {
  KvPool pool(2, 2);
  std::vector<int> toks = {1, 2, 3};
  int a = pool.allocate();
  pool.publish(a, KvPool::chain_hash(0, toks.data(), 2), std::vector<int>{9, 9}.data());
  EXPECT_TRUE(pool.lookup_prefix(toks).empty());
}

TEST(KvPool, FlushForgetsEveryHash) {
  KvPool pool(2, 2);
  std::vector<int> toks = {1, 2, 3};
  int a = pool.allocate();
  pool.publish(a, KvPool::chain_hash(0, toks.data(), 2), toks.data());
  EXPECT_EQ(pool.lookup_prefix(toks).size(), 1u);
  pool.flush();
  EXPECT_TRUE(pool.lookup_prefix(toks).empty());
  EXPECT_EQ(pool.hashed_blocks(), 0u);
}

}  // namespace
}  // namespace r3
