#ifndef SPECSERVE_COMMON_ENGINE_PREFIX_CACHE_H_
#define SPECSERVE_COMMON_ENGINE_PREFIX_CACHE_H_

#include <cstdint>
#include <list>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "common/engine/block_pool.h"

namespace specserve {

/// Automatic prefix caching (vLLM's APC; shared/seeds/apc_spec_decode_
/// splitfuse_vllm.md): a map from the content of a full KV block to the
/// pool block holding it, so that a request whose prompt starts with
/// blocks another request already computed attaches them (reference
/// counts) instead of recomputing them.
///
/// A block's key is the key of the block before it (the whole prefix:
/// attention is causal) combined with the block's token ids AND position
/// ids: Speculative Prefill's pruned prompts keep original positions, and
/// a kept token at position 37 has other keys and values than at 5. Keys
/// are 64-bit hashes; the block's tokens, positions and parent are stored
/// and compared on lookup, so a hash collision is a miss, never a wrong
/// hit.
///
/// The cache holds one reference on every block it lists; blocks no
/// sequence uses any more (reference count 1) are evicted least recently
/// used first when the pool runs out. Not thread-safe: PagedKvCache
/// serialises access.
class PrefixCache {
 public:
  /// The key of the (empty) prefix before the first block.
  static constexpr uint64_t kRootKey = 0x9e3779b97f4a7c15ull;

  explicit PrefixCache(BlockPool* pool) : pool_(pool) {}
  /// Drops the cache's reference on every listed block.
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  /// Key of a block with `tokens` / `positions` after the prefix `parent`.
  static uint64_t Key(uint64_t parent, absl::Span<const int> tokens,
                      absl::Span<const int> positions);

  /// The block listed under this exact content, or -1. A hit becomes the
  /// most recently used.
  int Lookup(uint64_t parent, absl::Span<const int> tokens,
             absl::Span<const int> positions);
  /// Lists `block` (full, final) under this content, taking a reference;
  /// false (nothing changes) if that content is listed already.
  bool Insert(uint64_t parent, absl::Span<const int> tokens,
              absl::Span<const int> positions, int block);
  /// Drops least recently used blocks that only the cache still holds
  /// until `n` pool blocks are free or none is left to drop; returns the
  /// blocks freed.
  int EvictForFree(int n);
  /// Listed blocks that only the cache holds (EvictForFree could free
  /// them). O(1): the pool counts them (one cache per pool).
  int num_evictable() const;

  /// Blocks listed.
  int size() const { return static_cast<int>(entries_.size()); }

 private:
  struct Entry {
    uint64_t parent;
    std::vector<int> tokens, positions;
    int block;
    std::list<uint64_t>::iterator lru;
  };
  BlockPool* pool_;
  absl::flat_hash_map<uint64_t, Entry> entries_;
  std::list<uint64_t> lru_;  // front = least recently used
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_PREFIX_CACHE_H_
