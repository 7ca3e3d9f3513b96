#ifndef SPECSERVE_COMMON_ENGINE_PAGED_KV_CACHE_H_
#define SPECSERVE_COMMON_ENGINE_PAGED_KV_CACHE_H_

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/engine/block_pool.h"
#include "common/engine/prefix_cache.h"

namespace specserve {

class KvSequence;

/// The paged KV cache of one model instance, shared by all its sequences
/// (PagedAttention, Kwon et al. SOSP 2023; vLLM v1's KVCacheManager): a
/// BlockPool of `num_blocks` blocks of `block_size` tokens. This class is
/// the bookkeeping only, identical on every backend; the backend's storage
/// holds, per layer, K and V planes of [num_blocks * block_size, kv_heads,
/// head_dim] rows (the CPU backend's f32 planes for 8/16-dim heads are
/// chunk-major within each block instead: kernels::ChunkMajorKvOffset),
/// and logical slot t of a sequence lives at physical row (slot)
/// block_table[t / block_size] * block_size + t % block_size.
/// Thread-safe (sequences are not: one owner each).
class PagedKvCache {
 public:
  /// Copies block `src`'s K and V rows (every layer) into block `dst`:
  /// the backend's copy-on-write when a sequence appends into a shared
  /// partially filled block.
  using BlockCopier = std::function<absl::Status(int src, int dst)>;

  /// `bytes_per_token`: K + V bytes of one token over all layers.
  /// `block_size` >= 1 tokens.
  PagedKvCache(int num_blocks, int block_size, size_t bytes_per_token,
               BlockCopier copier);

  /// Blocks that `bytes` of KV memory hold (>= 0).
  static int BlocksForBytes(size_t bytes, int block_size,
                            size_t bytes_per_token);
  /// Blocks that `tokens` tokens occupy: ceil(tokens / block_size).
  static int BlocksForTokens(int tokens, int block_size) {
    return (tokens + block_size - 1) / block_size;
  }

  /// A new empty sequence that may grow to `max_tokens` tokens (its
  /// context; Reserve past it is RESOURCE_EXHAUSTED). Sequences are
  /// numbered in creation order (KvSequence::id()).
  std::unique_ptr<KvSequence> NewSequence(int max_tokens);

  /// Blocks an allocation can get now: free blocks plus cached blocks no
  /// sequence uses (the prefix cache gives those up on demand).
  int num_available_blocks() const;

  int block_size() const { return block_size_; }
  int num_blocks() const { return pool_.num_blocks(); }
  int num_free_blocks() const { return pool_.num_free(); }
  size_t bytes_per_token() const { return bytes_per_token_; }
  size_t bytes_per_block() const { return bytes_per_token_ * block_size_; }
  /// Bytes of the whole pool, and of the blocks allocated now.
  size_t bytes_capacity() const { return bytes_per_block() * num_blocks(); }
  size_t bytes_used() const {
    return bytes_per_block() * (num_blocks() - num_free_blocks());
  }
  /// Bytes of the blocks sequences hold: allocated blocks less the cached
  /// ones no sequence uses (those are evictable, as good as free).
  size_t bytes_held() const {
    return bytes_per_block() * (num_blocks() - num_available_blocks());
  }
  /// Fraction of blocks sequences hold, [0, 1]: vLLM's
  /// kv_cache_usage_perc, where cached blocks no request uses count as
  /// free.
  double usage() const;

  BlockPool& pool() { return pool_; }
  const BlockPool& pool() const { return pool_; }

  /// Turns automatic prefix caching (PrefixCache) on or off; off drops
  /// every cached block no sequence uses.
  void EnablePrefixCaching(bool enable);
  bool prefix_caching() const;
  /// Prompt tokens looked up in the prefix cache, and of those found
  /// cached (vLLM's prefix_cache_queries / prefix_cache_hits), since
  /// creation.
  int64_t prefix_cache_queries() const;
  int64_t prefix_cache_hits() const;
  /// Blocks the prefix cache lists (some may also be in use).
  int prefix_cached_blocks() const;

 private:
  friend class KvSequence;
  // Takes `n` free blocks, first evicting cached blocks no sequence uses
  // when the pool is short. RESOURCE_EXHAUSTED as BlockPool::Allocate.
  absl::StatusOr<std::vector<int>> Allocate(int n);

  BlockPool pool_;
  const int block_size_;
  const size_t bytes_per_token_;
  BlockCopier copier_;
  std::atomic<uint64_t> next_id_{1};  // KvSequence ids, creation order
  mutable absl::Mutex mu_;  // the prefix cache and its counters
  std::unique_ptr<PrefixCache> prefix_ ABSL_GUARDED_BY(mu_);
  int64_t queries_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

/// One sequence's view of a PagedKvCache: its block table, token count and
/// the RoPE position id each cached token was rotated with. Positions need
/// not be contiguous: Speculative Prefill caches only the kept prompt
/// tokens, each at its original position. Releases its blocks when
/// destroyed. Not thread-safe; must not outlive its cache.
class KvSequence {
 public:
  ~KvSequence();
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  /// Creation order in its cache (older sequences have smaller ids): the
  /// priority of preemption, which takes blocks from the newest first.
  uint64_t id() const { return id_; }
  /// Cached tokens.
  int size() const { return size_; }
  /// Most tokens this sequence may hold (its context).
  int max_tokens() const { return max_tokens_; }
  int block_size() const { return cache_->block_size(); }
  /// Physical block ids, [BlocksForTokens(size())] (at least).
  const std::vector<int>& block_table() const { return blocks_; }
  /// Physical row of logical slot t (t < blocks held * block_size).
  int PhysicalSlot(int t) const {
    const int bs = cache_->block_size();
    return blocks_[t / bs] * bs + t % bs;
  }

  /// Reserves `n` more slots for a forward pass and returns the first
  /// logical slot: allocates blocks as needed and copies a shared partially
  /// filled last block first (copy-on-write). RESOURCE_EXHAUSTED (nothing
  /// changes) when size + n > max_tokens or the pool lacks blocks;
  /// INVALID_ARGUMENT for n < 0; the copier's error.
  absl::StatusOr<int> Reserve(int n);
  /// Blocks Reserve(n) would take from the pool now: the new blocks past
  /// the last one held, plus a copy of a shared partially filled last
  /// block (copy-on-write). n >= 0.
  int BlocksToReserve(int n) const;
  /// Records the position ids of slots [first, first + n) after Reserve.
  void SetPositions(int first, const int* positions, int n);

  /// Rolls back to the first `n` tokens (rejected drafts) and returns the
  /// blocks no longer needed to the pool. INVALID_ARGUMENT if n < 0 or
  /// n > size().
  absl::Status Truncate(int n);
  /// Drops every token and block.
  void Clear();

  /// Prefix caching: on an empty sequence, attaches the cached full blocks
  /// that hold the longest prefix of (token_ids, position_ids) (as many
  /// tokens as `max_tokens` allows, rounded down to whole blocks) and
  /// returns how many tokens they hold (0 when caching is off or nothing
  /// matches). Those tokens then need no forward.
  int AttachCachedPrefix(absl::Span<const int> token_ids,
                         absl::Span<const int> position_ids, int max_tokens);
  /// Lists this sequence's full blocks covering its first
  /// token_ids.size() tokens, which must be (token_ids, position_ids) and
  /// already forwarded, in the prefix cache. No-op when caching is off.
  void CachePrefix(absl::Span<const int> token_ids,
                   absl::Span<const int> position_ids);

  /// A new sequence with the same tokens that shares every block
  /// (reference counts; copy-on-write on the next append into a shared
  /// partial block). Costs no KV memory until one side appends.
  std::unique_ptr<KvSequence> Fork() const;

  /// MonotonicNowNs of the last Reserve (creation until then): how long
  /// the sequence has been idle, for the scheduler's preemption policy.
  int64_t last_used_ns() const {
    return last_used_ns_.load(std::memory_order_relaxed);
  }

  /// Position id of each cached token, [size()].
  const std::vector<int>& positions() const { return positions_; }
  /// Position of the last cached token, or -1 when empty.
  int last_position() const { return size_ ? positions_[size_ - 1] : -1; }

  /// Bytes of the blocks this sequence holds (shared blocks counted fully).
  size_t bytes_used() const {
    return cache_->bytes_per_block() * blocks_.size();
  }
  /// Bytes at max_tokens (blocks rounded up): what admission charges.
  size_t bytes_capacity() const;
  PagedKvCache* cache() const { return cache_; }

 private:
  friend class PagedKvCache;
  KvSequence(PagedKvCache* cache, int max_tokens);
  void ReleaseBlocksFrom(size_t keep);
  // Whether appending n tokens first copies a shared partial last block.
  bool SharesPartialBlock(int n) const;

  PagedKvCache* cache_;
  int max_tokens_;
  uint64_t id_ = 0;
  // MonotonicNowNs of the last Reserve (creation until then).
  std::atomic<int64_t> last_used_ns_;
  int size_ = 0;
  std::vector<int> blocks_;
  std::vector<int> positions_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_PAGED_KV_CACHE_H_
