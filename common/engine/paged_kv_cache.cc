#include "common/engine/paged_kv_cache.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/util/clock.h"

namespace specserve {

PagedKvCache::PagedKvCache(int num_blocks, int block_size,
                           size_t bytes_per_token, BlockCopier copier)
    : pool_(num_blocks),
      block_size_(block_size < 1 ? 1 : block_size),
      bytes_per_token_(bytes_per_token),
      copier_(std::move(copier)) {}

int PagedKvCache::BlocksForBytes(size_t bytes, int block_size,
                                 size_t bytes_per_token) {
  const size_t per_block = bytes_per_token * static_cast<size_t>(block_size);
  if (per_block == 0) return 0;
  const size_t n = bytes / per_block;
  return n > size_t{1} << 30 ? 1 << 30 : static_cast<int>(n);
}

absl::StatusOr<std::vector<int>> PagedKvCache::Allocate(int n) {
  {
    absl::MutexLock lock(&mu_);
    if (prefix_ != nullptr && pool_.num_free() < n) prefix_->EvictForFree(n);
  }
  return pool_.Allocate(n);
}

void PagedKvCache::EnablePrefixCaching(bool enable) {
  absl::MutexLock lock(&mu_);
  if (enable && prefix_ == nullptr) {
    prefix_ = std::make_unique<PrefixCache>(&pool_);
  } else if (!enable) {
    prefix_.reset();  // unreferences every cached block
  }
}

bool PagedKvCache::prefix_caching() const {
  absl::MutexLock lock(&mu_);
  return prefix_ != nullptr;
}

int64_t PagedKvCache::prefix_cache_queries() const {
  absl::MutexLock lock(&mu_);
  return queries_;
}

int64_t PagedKvCache::prefix_cache_hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}

int PagedKvCache::prefix_cached_blocks() const {
  absl::MutexLock lock(&mu_);
  return prefix_ == nullptr ? 0 : prefix_->size();
}

std::unique_ptr<KvSequence> PagedKvCache::NewSequence(int max_tokens) {
  return std::unique_ptr<KvSequence>(new KvSequence(this, max_tokens));
}

int PagedKvCache::num_available_blocks() const {
  int evictable = 0;
  {
    absl::MutexLock lock(&mu_);
    if (prefix_ != nullptr) evictable = prefix_->num_evictable();
  }
  return pool_.num_free() + evictable;
}

double PagedKvCache::usage() const {
  const int n = num_blocks();
  return n == 0 ? 0.0 : 1.0 - static_cast<double>(num_available_blocks()) / n;
}

KvSequence::KvSequence(PagedKvCache* cache, int max_tokens)
    : cache_(cache),
      max_tokens_(max_tokens),
      id_(cache->next_id_.fetch_add(1, std::memory_order_relaxed)),
      last_used_ns_(MonotonicNowNs()) {}

KvSequence::~KvSequence() { ReleaseBlocksFrom(0); }

bool KvSequence::SharesPartialBlock(int n) const {
  // The next write lands in a partially filled block shared with another
  // sequence: it is copied first so the other side's tokens stay intact.
  const int bs = cache_->block_size();
  return n > 0 && size_ % bs != 0 &&
         cache_->pool_.ref_count(blocks_[size_ / bs]) > 1;
}

int KvSequence::BlocksToReserve(int n) const {
  const int have = static_cast<int>(blocks_.size());
  const int need = PagedKvCache::BlocksForTokens(size_ + std::max(n, 0),
                                                 cache_->block_size());
  return (need > have ? need - have : 0) + (SharesPartialBlock(n) ? 1 : 0);
}

void KvSequence::ReleaseBlocksFrom(size_t keep) {
  for (size_t i = keep; i < blocks_.size(); ++i) {
    cache_->pool_.Unref(blocks_[i]).IgnoreError();  // ids are ours: cannot fail
  }
  if (keep < blocks_.size()) blocks_.resize(keep);
}

size_t KvSequence::bytes_capacity() const {
  return cache_->bytes_per_block() *
         PagedKvCache::BlocksForTokens(max_tokens_, cache_->block_size());
}

absl::StatusOr<int> KvSequence::Reserve(int n) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot reserve ", n, " KV slots"));
  }
  if (static_cast<int64_t>(size_) + n > max_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: ", size_, " cached + ", n,
                     " new tokens exceed the sequence's capacity ",
                     max_tokens_));
  }
  last_used_ns_.store(MonotonicNowNs(), std::memory_order_relaxed);
  const int bs = cache_->block_size();
  const bool cow = SharesPartialBlock(n);
  const int fresh = BlocksToReserve(n);
  if (fresh > 0) {
    absl::StatusOr<std::vector<int>> got = cache_->Allocate(fresh);
    if (!got.ok()) return got.status();
    size_t next = 0;
    if (cow) {
      const int shared = blocks_[size_ / bs];
      const int copy = (*got)[next++];
      if (cache_->copier_) {
        if (absl::Status s = cache_->copier_(shared, copy); !s.ok()) {
          for (int b : *got) cache_->pool_.Unref(b).IgnoreError();
          return s;
        }
      }
      blocks_[size_ / bs] = copy;
      cache_->pool_.Unref(shared).IgnoreError();
    }
    for (; next < got->size(); ++next) blocks_.push_back((*got)[next]);
  }
  const int first = size_;
  size_ += n;
  positions_.resize(size_, -1);
  return first;
}

void KvSequence::SetPositions(int first, const int* positions, int n) {
  for (int i = 0; i < n; ++i) positions_[first + i] = positions[i];
}

absl::Status KvSequence::Truncate(int n) {
  if (n < 0 || n > size_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot truncate KV cache of ", size_, " tokens to ", n));
  }
  size_ = n;
  positions_.resize(n);
  ReleaseBlocksFrom(PagedKvCache::BlocksForTokens(n, cache_->block_size()));
  return absl::OkStatus();
}

void KvSequence::Clear() {
  size_ = 0;
  positions_.clear();
  ReleaseBlocksFrom(0);
}

int KvSequence::AttachCachedPrefix(absl::Span<const int> token_ids,
                                   absl::Span<const int> position_ids,
                                   int max_tokens) {
  PagedKvCache& c = *cache_;
  absl::MutexLock lock(&c.mu_);
  if (c.prefix_ == nullptr || size_ != 0 ||
      token_ids.size() != position_ids.size()) {
    return 0;
  }
  const int bs = c.block_size_;
  const int limit = std::min<int>(
      {max_tokens, static_cast<int>(token_ids.size()), max_tokens_});
  c.queries_ += static_cast<int64_t>(token_ids.size());
  uint64_t parent = PrefixCache::kRootKey;
  for (int t = 0; t + bs <= limit; t += bs) {
    const auto toks = token_ids.subspan(t, bs);
    const auto pos = position_ids.subspan(t, bs);
    const int block = c.prefix_->Lookup(parent, toks, pos);
    if (block < 0 || !c.pool_.Ref(block).ok()) break;
    blocks_.push_back(block);
    positions_.insert(positions_.end(), pos.begin(), pos.end());
    size_ += bs;
    parent = PrefixCache::Key(parent, toks, pos);
  }
  c.hits_ += size_;
  return size_;
}

void KvSequence::CachePrefix(absl::Span<const int> token_ids,
                             absl::Span<const int> position_ids) {
  PagedKvCache& c = *cache_;
  absl::MutexLock lock(&c.mu_);
  if (c.prefix_ == nullptr || token_ids.size() != position_ids.size()) return;
  const int bs = c.block_size_;
  const int n = std::min<int>(static_cast<int>(token_ids.size()), size_);
  uint64_t parent = PrefixCache::kRootKey;
  for (int t = 0; t + bs <= n; t += bs) {
    const auto toks = token_ids.subspan(t, bs);
    const auto pos = position_ids.subspan(t, bs);
    c.prefix_->Insert(parent, toks, pos, blocks_[t / bs]);
    parent = PrefixCache::Key(parent, toks, pos);
  }
}

std::unique_ptr<KvSequence> KvSequence::Fork() const {
  std::unique_ptr<KvSequence> f(new KvSequence(cache_, max_tokens_));
  for (int b : blocks_) cache_->pool_.Ref(b).IgnoreError();  // ours: live
  f->blocks_ = blocks_;
  f->size_ = size_;
  f->positions_ = positions_;
  return f;
}

}  // namespace specserve
