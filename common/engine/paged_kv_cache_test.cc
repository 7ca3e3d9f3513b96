#include "common/engine/paged_kv_cache.h"

#include "common/util/clock.h"

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

// The pool's O(1) count of blocks held by a cache alone equals a scan of
// the reference counts after every random Ref / Unref / RefCached /
// UnrefCached; Unref never drops a cache's reference.
TEST(BlockPoolTest, CachedIdleCountEqualsAScan) {
  const int n = 12;
  BlockPool pool(n);
  std::vector<int> refs(n, 0), cached(n, 0);
  std::mt19937 rng(7);
  for (int op = 0; op < 5000; ++op) {
    const int b = rng() % n;
    switch (rng() % 5) {
      case 0:
        if (refs[b] == 0 && pool.num_free() > 0) {
          auto got = pool.Allocate(1);
          ASSERT_TRUE(got.ok());
          refs[(*got)[0]] = 1;
        }
        break;
      case 1:
        ASSERT_EQ(pool.Ref(b).ok(), refs[b] > 0);
        if (refs[b] > 0) ++refs[b];
        break;
      case 2:
        ASSERT_EQ(pool.RefCached(b).ok(), refs[b] > 0);
        if (refs[b] > 0) ++refs[b], ++cached[b];
        break;
      case 3: {
        const bool ok = refs[b] > cached[b];
        ASSERT_EQ(pool.Unref(b).ok(), ok);
        if (ok) --refs[b];
        break;
      }
      case 4:
        ASSERT_EQ(pool.UnrefCached(b).ok(), cached[b] > 0);
        if (cached[b] > 0) --refs[b], --cached[b];
        break;
    }
    int idle = 0, free_blocks = 0;
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(pool.ref_count(i), refs[i]);
      idle += cached[i] > 0 && refs[i] == 1;
      free_blocks += refs[i] == 0;
    }
    ASSERT_EQ(pool.num_cached_idle(), idle) << "op " << op;
    ASSERT_EQ(pool.num_free(), free_blocks);
  }
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
    if (block_size > 1) {
      EXPECT_GT(copies, 0);
    }
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

// Automatic prefix caching: whole blocks of (tokens, positions) are shared
// by a later sequence with the same prefix; positions are part of the key;
// unused cached blocks are evicted when the pool runs short, in-use ones
// never.
TEST(PagedKvCacheTest, PrefixCachingSharesWholeBlocksByTokensAndPositions) {
  const int bs = 4;
  PagedKvCache cache(8, bs, /*bytes_per_token=*/8, nullptr);
  cache.EnablePrefixCaching(true);
  std::vector<int> toks(11), pos(11);
  for (int i = 0; i < 11; ++i) {
    toks[i] = 100 + i;
    pos[i] = 3 * i;  // pruned positions
  }
  auto a = cache.NewSequence(32);
  EXPECT_EQ(a->AttachCachedPrefix(toks, pos, 10), 0);  // nothing cached yet
  ASSERT_TRUE(a->Reserve(11).ok());
  a->SetPositions(0, pos.data(), 11);
  a->CachePrefix(toks, pos);  // two full blocks; the third is partial
  EXPECT_EQ(cache.prefix_cached_blocks(), 2);

  auto b = cache.NewSequence(32);
  EXPECT_EQ(b->AttachCachedPrefix(toks, pos, 10), 8);
  EXPECT_EQ(b->size(), 8);
  EXPECT_EQ(b->block_table()[0], a->block_table()[0]);
  EXPECT_EQ(b->block_table()[1], a->block_table()[1]);
  EXPECT_EQ(b->positions(), std::vector<int>(pos.begin(), pos.begin() + 8));
  EXPECT_EQ(cache.pool().ref_count(a->block_table()[0]), 3);  // a, b, cache
  // A cap below one block attaches nothing; the same tokens at other
  // positions, or a different first block, miss.
  auto c = cache.NewSequence(32);
  EXPECT_EQ(c->AttachCachedPrefix(toks, pos, 3), 0);
  std::vector<int> shifted = pos;
  for (int& p : shifted) p += 1;
  EXPECT_EQ(c->AttachCachedPrefix(toks, shifted, 10), 0);
  std::vector<int> other = toks;
  other[0] = 7;
  EXPECT_EQ(c->AttachCachedPrefix(other, pos, 10), 0);
  // Only the second block differs: the first is still shared.
  std::vector<int> tail = toks;
  tail[5] = 9;
  EXPECT_EQ(c->AttachCachedPrefix(tail, pos, 10), 4);
  EXPECT_EQ(cache.prefix_cache_queries(), 11 * 6);
  EXPECT_EQ(cache.prefix_cache_hits(), 8 + 4);
  // Appending after attached blocks writes new blocks: the cached ones
  // stay intact.
  ASSERT_TRUE(b->Reserve(3).ok());
  EXPECT_NE(b->block_table()[2], a->block_table()[2]);

  // Eviction: with every sequence gone, the cache alone holds its 2
  // blocks; allocating the whole pool evicts them.
  a.reset();
  b.reset();
  c.reset();
  EXPECT_EQ(cache.num_free_blocks(), 6);
  auto big = cache.NewSequence(32);
  ASSERT_TRUE(big->Reserve(32).ok());
  EXPECT_EQ(cache.prefix_cached_blocks(), 0);
  EXPECT_EQ(cache.num_free_blocks(), 0);
  big.reset();
  // A cached block in use is never evicted: exhaustion instead.
  auto d = cache.NewSequence(32);
  ASSERT_TRUE(d->Reserve(8).ok());
  d->SetPositions(0, pos.data(), 8);
  d->CachePrefix(absl::MakeConstSpan(toks).subspan(0, 8),
                 absl::MakeConstSpan(pos).subspan(0, 8));
  auto e = cache.NewSequence(32);
  EXPECT_EQ(e->Reserve(28).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.prefix_cached_blocks(), 2);
  // Turning caching off drops the cache's references.
  cache.EnablePrefixCaching(false);
  EXPECT_EQ(cache.pool().ref_count(d->block_table()[0]), 1);
  d.reset();
  EXPECT_EQ(cache.num_free_blocks(), 8);
}

}  // namespace
}  // namespace specserve

namespace specserve {
namespace {

// BlocksToReserve counts new blocks and the copy-on-write of a shared
// partial block.
TEST(PagedKvCacheTest, BlocksToReserveCountsNewAndCopiedBlocks) {
  PagedKvCache cache(8, 4, /*bytes_per_token=*/10, nullptr);
  std::vector<std::unique_ptr<KvSequence>> seqs;
  for (int i = 0; i < 4; ++i) {
    seqs.push_back(cache.NewSequence(32));
    ASSERT_TRUE(seqs.back()->Reserve(8).ok());  // 2 blocks each: pool full
  }
  EXPECT_EQ(cache.num_free_blocks(), 0);
  EXPECT_EQ(seqs[0]->BlocksToReserve(1), 1);
  EXPECT_EQ(seqs[0]->BlocksToReserve(0), 0);
  EXPECT_EQ(seqs[0]->Reserve(1).status().code(),
            absl::StatusCode::kResourceExhausted);
  seqs[3].reset();
  seqs[2].reset();

  // Copy-on-write: a fork sharing a partial last block needs a copy of it.
  auto fork = seqs[1]->Fork();
  ASSERT_TRUE(seqs[1]->Truncate(6).ok());
  auto part = seqs[1]->Fork();
  EXPECT_EQ(part->BlocksToReserve(1), 1);  // copy of the shared partial block
  EXPECT_EQ(part->BlocksToReserve(3), 2);  // copy + one new block
}

}  // namespace
}  // namespace specserve

