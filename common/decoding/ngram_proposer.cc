#include "common/decoding/ngram_proposer.h"

#include <algorithm>

#include "absl/hash/hash.h"

namespace specserve {
namespace {

// One more token, further left, into an n-gram's hash.
uint64_t Extend(uint64_t hash, int token) {
  return absl::HashOf(hash, token);
}

}  // namespace

std::vector<int> PromptLookupReference(absl::Span<const int> context,
                                       int min_n, int max_n, int k) {
  const int size = static_cast<int>(context.size());
  if (k <= 0) return {};
  for (int n = std::min(max_n, size - 1); n >= min_n; --n) {
    const absl::Span<const int> suffix = context.subspan(size - n);
    // Earlier occurrences start before the suffix does.
    for (int start = size - n - 1; start >= 0; --start) {
      if (std::equal(suffix.begin(), suffix.end(),
                     context.begin() + start)) {
        const int from = start + n;
        const int to = std::min(from + k, size);
        return std::vector<int>(context.begin() + from, context.begin() + to);
      }
    }
  }
  return {};
}

NgramProposer::NgramProposer(int min_n, int max_n)
    : min_n_(std::clamp(min_n, 1, kMaxPromptLookup)),
      max_n_(std::clamp(max_n, min_n_, kMaxPromptLookup)),
      index_(max_n_ - min_n_ + 1) {}

int NgramProposer::SuffixHashes(int end, uint64_t* hashes) const {
  const int count = std::min(end, max_n_);
  uint64_t h = 0;
  for (int n = 1; n <= count; ++n) {
    h = Extend(h, tokens_[end - n]);
    hashes[n - 1] = h;
  }
  return count;
}

bool NgramProposer::SameNgram(int a, int b, int n) const {
  return std::equal(tokens_.begin() + (a - n), tokens_.begin() + a,
                    tokens_.begin() + (b - n));
}

void NgramProposer::Append(int token) {
  // The previous suffix stops being the suffix: index its n-grams (a later
  // occurrence overwrites an earlier one, so each map keeps the latest).
  const int end = static_cast<int>(tokens_.size());
  if (end > 0) {
    uint64_t hashes[kMaxPromptLookup];
    const int count = SuffixHashes(end, hashes);
    for (int n = min_n_; n <= count; ++n) {
      index_[n - min_n_][hashes[n - 1]] = end;
    }
  }
  tokens_.push_back(token);
}

void NgramProposer::Append(absl::Span<const int> tokens) {
  tokens_.reserve(tokens_.size() + tokens.size());
  for (int t : tokens) Append(t);
}

std::vector<int> NgramProposer::Propose(int k) const {
  int unused;
  return Propose(k, &unused);
}

std::vector<int> NgramProposer::Propose(int k, int* matched_n) const {
  *matched_n = 0;
  const int size = static_cast<int>(tokens_.size());
  if (k <= 0 || size < 2) return {};
  uint64_t hashes[kMaxPromptLookup];
  const int count = SuffixHashes(size, hashes);
  for (int n = std::min(max_n_, count); n >= min_n_; --n) {
    const auto& map = index_[n - min_n_];
    auto it = map.find(hashes[n - 1]);
    if (it == map.end()) continue;
    const int end = it->second;  // < size: the suffix is never indexed
    if (end < n || !SameNgram(end, size, n)) continue;  // a hash collision
    *matched_n = n;
    const int to = std::min(end + k, size);
    return std::vector<int>(tokens_.begin() + end, tokens_.begin() + to);
  }
  return {};
}

}  // namespace specserve
