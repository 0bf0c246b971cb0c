// The KV cache's memory (engine/kv_cache.h): zeros that cost nothing until written, handed back
// by release, zeros again after restore.
#include "engine/kv_cache.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/resident_memory.h"

namespace r3 {
namespace {

TEST(KvCache, ZerosCommittedOnlyWhereWritten) {
  // 4 layers x 2049 blocks x 16 slots x 2048 elements, K and V: 1 GiB of fp32.
  const int layers = 4, blocks = 2048, bs = 16, width = 2048, head_dim = 64;
  const double before = resident_mb();
  KvCache<float> cache(layers, blocks, bs, width, width);
  EXPECT_LT(resident_mb() - before, 64.0) << "constructing the cache committed its memory";
  std::vector<float> k(size_t(width), 1.5f), v(size_t(width), -2.f);
  cache.write_gqa(3, 1000, 7, k.data(), v.data(), head_dim);
  const size_t block_elems = size_t(bs) * size_t(width);
  EXPECT_EQ(cache.k_layer(3)[1000 * block_elems + 7], 1.5f);
  EXPECT_EQ(cache.v_layer(3)[1000 * block_elems + 7 * head_dim], -2.f);
  EXPECT_EQ(cache.k_layer(3)[1000 * block_elems + 8], 0.f);  // a slot never written
  EXPECT_EQ(cache.k_layer(0)[0], 0.f);
  EXPECT_EQ(cache.v_layer(2)[size_t(blocks) * block_elems],
            0.f);  // the padding tokens' scratch block
  EXPECT_LT(resident_mb() - before, 64.0) << "one block's write committed more than its pages";

  cache.release();
  EXPECT_TRUE(cache.released());
  cache.restore();
  EXPECT_EQ(cache.k_layer(3)[1000 * block_elems + 7], 0.f)
      << "restore keeps a released block's keys";
  EXPECT_EQ(cache.v_layer(3)[1000 * block_elems + 7 * head_dim], 0.f);
}

// Below 2 MiB the memory comes from the heap, which may hand back freed memory: zeroed too.
TEST(KvCache, SmallCacheStartsAsZeros) {
  for (int round = 0; round < 4; ++round) {
    {
      std::vector<float> garbage(4096, -7.f);
      (void)garbage.data();
    }
    KvCache<uint16_t> cache(2, 3, 16, 32, 32);
    const size_t elems = size_t(3 + 1) * 16 * 32;
    for (int l = 0; l < 2; ++l)
      for (size_t i = 0; i < elems; ++i) {
        ASSERT_EQ(cache.k_layer(l)[i], 0) << "layer " << l << " element " << i;
        ASSERT_EQ(cache.v_layer(l)[i], 0) << "layer " << l << " element " << i;
      }
    cache.write_gqa(1, 2, 3, std::vector<float>(32, 1.f).data(), std::vector<float>(32, 2.f).data(),
                    8);
  }
}

}  // namespace
}  // namespace r3
