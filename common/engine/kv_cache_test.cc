#include "common/engine/kv_cache.h"

#include "gtest/gtest.h"

namespace specserve {
namespace {

ModelConfig SmallConfig() {
  ModelConfig c;
  c.hidden_size = 16;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.max_position_embeddings = 32;
  return c;
}

TEST(KvCacheTest, ReserveTruncateAndCapacity) {
  KvCache cache(SmallConfig(), 8);
  EXPECT_EQ(cache.row_width(), 8);
  auto first = cache.Reserve(5);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 0);
  const int pos[5] = {0, 3, 4, 9, 10};
  cache.SetPositions(0, pos, 5);
  EXPECT_EQ(cache.last_position(), 10);
  EXPECT_EQ(cache.bytes_used(), 2u * 4 * 2 * 8 * 5);
  EXPECT_EQ(cache.Reserve(4).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.size(), 5);  // a failed reserve changes nothing
  ASSERT_TRUE(cache.Truncate(2).ok());
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.last_position(), 3);
  EXPECT_EQ(cache.Truncate(3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Truncate(-1).code(), absl::StatusCode::kInvalidArgument);
  auto next = cache.Reserve(6);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, 2);
  EXPECT_EQ(cache.size(), 8);
  cache.Clear();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(cache.last_position(), -1);
}

TEST(KvCacheTest, CreateValidatesCapacity) {
  EXPECT_FALSE(KvCache::Create(SmallConfig(), 0).ok());
  EXPECT_FALSE(KvCache::Create(SmallConfig(), 33).ok());
  EXPECT_TRUE(KvCache::Create(SmallConfig(), 32).ok());
  EXPECT_EQ(KvCache::BytesPerToken(SmallConfig()), 2u * 4 * 2 * 8);
}

}  // namespace
}  // namespace specserve
