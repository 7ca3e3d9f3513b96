#include "common/engine/block_pool.h"

#include "absl/strings/str_cat.h"

namespace specserve {

BlockPool::BlockPool(int num_blocks)
    : num_blocks_(num_blocks < 0 ? 0 : num_blocks) {
  free_.reserve(num_blocks_);
  // Block 0 on top of the stack: fresh pools hand out ascending ids.
  for (int b = num_blocks_ - 1; b >= 0; --b) free_.push_back(b);
  refs_.assign(num_blocks_, 0);
  cached_refs_.assign(num_blocks_, 0);
}

void BlockPool::Change(int block, int delta_refs, int delta_cached) {
  num_cached_idle_ -= CachedIdle(block);
  refs_[block] += delta_refs;
  cached_refs_[block] += delta_cached;
  num_cached_idle_ += CachedIdle(block);
  if (refs_[block] == 0) free_.push_back(block);
}

absl::StatusOr<std::vector<int>> BlockPool::Allocate(int n) {
  absl::MutexLock lock(&mu_);
  if (n < 0 || n > static_cast<int>(free_.size())) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache out of blocks: ", n, " needed, ", free_.size(),
                     " of ", num_blocks_, " free"));
  }
  // Pop order: a fresh pool hands out ascending ids, so a sequence that
  // grows alone gets physically contiguous blocks (attention then reads
  // them in place, without a gather).
  std::vector<int> out(free_.rbegin(), free_.rbegin() + n);
  free_.resize(free_.size() - n);
  for (int b : out) refs_[b] = 1;
  return out;
}

absl::Status BlockPool::Ref(int block) { return AddRef(block, 0); }

absl::Status BlockPool::RefCached(int block) { return AddRef(block, 1); }

absl::Status BlockPool::AddRef(int block, int cached) {
  absl::MutexLock lock(&mu_);
  if (block < 0 || block >= num_blocks_ || refs_[block] == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Ref of block ", block, " which is not allocated"));
  }
  Change(block, 1, cached);
  return absl::OkStatus();
}

absl::Status BlockPool::UnrefCached(int block) {
  absl::MutexLock lock(&mu_);
  if (block < 0 || block >= num_blocks_ || cached_refs_[block] == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Unref of block ", block, " which no cache holds"));
  }
  Change(block, -1, -1);
  return absl::OkStatus();
}

absl::Status BlockPool::Unref(int block) {
  absl::MutexLock lock(&mu_);
  if (block < 0 || block >= num_blocks_ || refs_[block] == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unref of block ", block, " which is not allocated"));
  }
  if (refs_[block] == cached_refs_[block]) {
    // The remaining references are a cache's: only UnrefCached drops them.
    return absl::InvalidArgumentError(absl::StrCat(
        "Unref of block ", block, " which only a cache holds"));
  }
  Change(block, -1, 0);
  return absl::OkStatus();
}

int BlockPool::ref_count(int block) const {
  absl::MutexLock lock(&mu_);
  if (block < 0 || block >= num_blocks_) return -1;
  return refs_[block];
}

int BlockPool::num_cached_idle() const {
  absl::MutexLock lock(&mu_);
  return num_cached_idle_;
}

int BlockPool::num_free() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(free_.size());
}

}  // namespace specserve
