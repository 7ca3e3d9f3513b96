#ifndef SPECSERVE_COMMON_ENGINE_BLOCK_POOL_H_
#define SPECSERVE_COMMON_ENGINE_BLOCK_POOL_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace specserve {

/// The KV cache's block allocator (vLLM v1's BlockPool, PagedAttention,
/// Kwon et al. SOSP 2023): `num_blocks` fixed-size blocks identified by ids
/// [0, num_blocks), a free list, and a reference count per block so that
/// sequences can share blocks (fork, prefix caching). Holds no tensors: the
/// backend's storage is indexed by block id. Thread-safe.
class BlockPool {
 public:
  /// `num_blocks` >= 0 blocks, all free.
  explicit BlockPool(int num_blocks);

  /// Takes `n` free blocks (reference count 1 each), most recently freed
  /// first (their memory is warm). RESOURCE_EXHAUSTED naming the counts
  /// when fewer than `n` are free; then nothing is taken.
  absl::StatusOr<std::vector<int>> Allocate(int n);

  /// Adds one reference to an allocated block (a second sequence shares
  /// it). INVALID_ARGUMENT for an id outside the pool or a free block.
  absl::Status Ref(int block);

  /// Drops one reference; the block returns to the free list at 0.
  /// INVALID_ARGUMENT for an id outside the pool or a free block.
  absl::Status Unref(int block);

  /// Ref / Unref on behalf of a cache that lists the block (prefix
  /// caching): the pool then counts the block as cached-idle while that is
  /// its only reference, so `num_cached_idle` needs no scan. Same errors as
  /// Ref / Unref; UnrefCached also INVALID_ARGUMENT for a block the cache
  /// does not hold.
  absl::Status RefCached(int block);
  absl::Status UnrefCached(int block);

  /// References held on `block` (0 = free); -1 for an id outside the pool.
  int ref_count(int block) const;
  int num_blocks() const { return num_blocks_; }
  int num_free() const;
  /// Blocks whose only reference is a cache's (what evicting could free).
  /// O(1).
  int num_cached_idle() const;

 private:
  // Whether `block` is held by a cache alone.
  bool CachedIdle(int block) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return cached_refs_[block] > 0 && refs_[block] == 1;
  }
  // Ref (cached = 0) or RefCached (cached = 1).
  absl::Status AddRef(int block, int cached);
  // Applies `delta_refs` / `delta_cached` to an allocated block, keeping
  // the free list and num_cached_idle_ in step.
  void Change(int block, int delta_refs, int delta_cached)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int num_blocks_;
  mutable absl::Mutex mu_;
  std::vector<int> free_ ABSL_GUARDED_BY(mu_);  // a stack of free ids
  std::vector<int32_t> refs_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> cached_refs_ ABSL_GUARDED_BY(mu_);  // of refs_
  int num_cached_idle_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_BLOCK_POOL_H_
