#include "common/engine/prefix_cache.h"

#include <tuple>

#include "absl/hash/hash.h"

namespace specserve {

PrefixCache::~PrefixCache() {
  for (const auto& [key, e] : entries_) {
    pool_->UnrefCached(e.block).IgnoreError();
  }
}

uint64_t PrefixCache::Key(uint64_t parent, absl::Span<const int> tokens,
                          absl::Span<const int> positions) {
  return absl::Hash<std::tuple<uint64_t, absl::Span<const int>,
                               absl::Span<const int>>>{}(
      std::make_tuple(parent, tokens, positions));
}

int PrefixCache::Lookup(uint64_t parent, absl::Span<const int> tokens,
                        absl::Span<const int> positions) {
  auto it = entries_.find(Key(parent, tokens, positions));
  if (it == entries_.end()) return -1;
  Entry& e = it->second;
  if (e.parent != parent || absl::MakeConstSpan(e.tokens) != tokens ||
      absl::MakeConstSpan(e.positions) != positions) {
    return -1;  // a hash collision
  }
  lru_.splice(lru_.end(), lru_, e.lru);
  return e.block;
}

bool PrefixCache::Insert(uint64_t parent, absl::Span<const int> tokens,
                         absl::Span<const int> positions, int block) {
  const uint64_t key = Key(parent, tokens, positions);
  if (entries_.contains(key)) return false;
  if (!pool_->RefCached(block).ok()) return false;
  lru_.push_back(key);
  entries_.emplace(key, Entry{parent,
                              std::vector<int>(tokens.begin(), tokens.end()),
                              std::vector<int>(positions.begin(),
                                               positions.end()),
                              block, std::prev(lru_.end())});
  return true;
}

int PrefixCache::EvictForFree(int n) {
  int freed = 0;
  for (auto it = lru_.begin(); it != lru_.end() && pool_->num_free() < n;) {
    auto e = entries_.find(*it);
    const int block = e->second.block;
    if (pool_->ref_count(block) != 1) {  // a sequence still uses it
      ++it;
      continue;
    }
    pool_->UnrefCached(block).IgnoreError();
    entries_.erase(e);
    it = lru_.erase(it);
    ++freed;
  }
  return freed;
}

int PrefixCache::num_evictable() const { return pool_->num_cached_idle(); }

}  // namespace specserve
