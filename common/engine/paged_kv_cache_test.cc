#include "common/engine/paged_kv_cache.h"

#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace specserve {
namespace {

TEST(BlockPoolTest, AllocateRefUnrefAndExhaustion) {
  BlockPool pool(4);
  auto a = pool.Allocate(3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<int>{0, 1, 2}));  // fresh pools: ascending
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.Allocate(2).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.num_free(), 1);  // a failed Allocate takes nothing
  ASSERT_TRUE(pool.Ref(1).ok());
  EXPECT_EQ(pool.ref_count(1), 2);
  ASSERT_TRUE(pool.Unref(1).ok());
  EXPECT_EQ(pool.num_free(), 1);
  ASSERT_TRUE(pool.Unref(1).ok());
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.Unref(1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Ref(3).code(), absl::StatusCode::kInvalidArgument);  // free
  EXPECT_EQ(pool.Ref(9).code(), absl::StatusCode::kInvalidArgument);
  auto b = pool.Allocate(1);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)[0], 1);  // most recently freed first
}

// Random append / truncate / fork / free against a simple model: each
// sequence is a vector of token values; the "storage" is one int per
// physical slot, written on append and copied by the copier. After every
// operation every sequence reads back its model through its block table,
// the pool's free count and reference counts equal what the live block
// tables imply, and RESOURCE_EXHAUSTED happens exactly when the model says
// the pool lacks blocks.
TEST(PagedKvCacheTest, RandomOperationsMatchAModelOfTheBlockAccounting) {
  for (int block_size : {1, 3, 16}) {
    SCOPED_TRACE(block_size);
    const int num_blocks = 40;
    std::vector<int> storage(num_blocks * block_size, -1);
    int copies = 0;
    PagedKvCache cache(num_blocks, block_size, /*bytes_per_token=*/8,
                       [&](int src, int dst) {
                         ++copies;
                         for (int i = 0; i < block_size; ++i) {
                           storage[dst * block_size + i] =
                               storage[src * block_size + i];
                         }
                         return absl::OkStatus();
                       });
    std::mt19937 rng(1234 + block_size);
    std::vector<std::unique_ptr<KvSequence>> seqs;
    std::vector<std::vector<int>> model;
    int next_value = 0;
    const int kMaxTokens = 200;

    auto check = [&]() {
      std::map<int, int> refs;
      for (size_t s = 0; s < seqs.size(); ++s) {
        const KvSequence& q = *seqs[s];
        ASSERT_EQ(q.size(), static_cast<int>(model[s].size()));
        ASSERT_EQ(static_cast<int>(q.block_table().size()),
                  PagedKvCache::BlocksForTokens(q.size(), block_size));
        for (int t = 0; t < q.size(); ++t) {
          ASSERT_EQ(storage[q.PhysicalSlot(t)], model[s][t])
              << "seq " << s << " slot " << t;
        }
        for (int b : q.block_table()) ++refs[b];
      }
      ASSERT_EQ(cache.num_free_blocks(),
                num_blocks - static_cast<int>(refs.size()));
      for (const auto& [b, n] : refs) ASSERT_EQ(cache.pool().ref_count(b), n);
    };

    for (int op = 0; op < 3000; ++op) {
      const int kind = rng() % 10;
      if (seqs.empty() || kind == 0) {
        seqs.push_back(cache.NewSequence(kMaxTokens));
        model.emplace_back();
      } else {
        const size_t s = rng() % seqs.size();
        KvSequence& q = *seqs[s];
        if (kind <= 4) {  // append n tokens
          const int n = 1 + rng() % (2 * block_size + 2);
          const int have = static_cast<int>(q.block_table().size());
          const int need =
              PagedKvCache::BlocksForTokens(q.size() + n, block_size);
          const bool cow = q.size() % block_size != 0 &&
                           cache.pool().ref_count(
                               q.block_table()[q.size() / block_size]) > 1;
          const int fresh = std::max(0, need - have) + (cow ? 1 : 0);
          const bool should_fail = q.size() + n > kMaxTokens ||
                                   fresh > cache.num_free_blocks();
          absl::StatusOr<int> first = q.Reserve(n);
          if (should_fail) {
            ASSERT_FALSE(first.ok());
            ASSERT_EQ(first.status().code(),
                      absl::StatusCode::kResourceExhausted);
          } else {
            ASSERT_TRUE(first.ok()) << first.status();
            ASSERT_EQ(*first, static_cast<int>(model[s].size()));
            for (int i = 0; i < n; ++i) {
              storage[q.PhysicalSlot(*first + i)] = next_value;
              model[s].push_back(next_value++);
            }
          }
        } else if (kind <= 6) {  // truncate (rollback)
          const int n = q.size() ? static_cast<int>(rng() % (q.size() + 1)) : 0;
          ASSERT_TRUE(q.Truncate(n).ok());
          model[s].resize(n);
          EXPECT_EQ(q.Truncate(n + 1).code(),
                    absl::StatusCode::kInvalidArgument);
        } else if (kind <= 8) {  // fork
          seqs.push_back(q.Fork());
          model.push_back(model[s]);
        } else {  // free
          seqs.erase(seqs.begin() + s);
          model.erase(model.begin() + s);
        }
      }
      check();
      if (::testing::Test::HasFatalFailure()) return;
    }
    // Copy-on-write was exercised (a block of one token is never partial).
    if (block_size > 1) EXPECT_GT(copies, 0);
    seqs.clear();
    EXPECT_EQ(cache.num_free_blocks(), num_blocks);
  }
}

TEST(PagedKvCacheTest, SizesAndUsage) {
  PagedKvCache cache(10, 16, /*bytes_per_token=*/100, nullptr);
  EXPECT_EQ(cache.bytes_per_block(), 1600u);
  EXPECT_EQ(cache.bytes_capacity(), 16000u);
  EXPECT_EQ(PagedKvCache::BlocksForBytes(16000, 16, 100), 10);
  EXPECT_EQ(PagedKvCache::BlocksForBytes(1599, 16, 100), 0);
  auto s = cache.NewSequence(40);
  EXPECT_EQ(s->bytes_capacity(), 3 * 1600u);
  ASSERT_TRUE(s->Reserve(17).ok());
  EXPECT_EQ(s->bytes_used(), 2 * 1600u);
  EXPECT_DOUBLE_EQ(cache.usage(), 0.2);
  EXPECT_EQ(s->Reserve(24).status().code(),
            absl::StatusCode::kResourceExhausted);  // past max_tokens
  EXPECT_EQ(s->Reserve(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specserve
