#ifndef SPECSERVE_COMMON_DECODING_NGRAM_PROPOSER_H_
#define SPECSERVE_COMMON_DECODING_NGRAM_PROPOSER_H_

// Prompt-lookup decoding: drafts without a draft model (Saxena's "prompt
// lookup decoding"; vLLM's speculative_config method "ngram"; llama.cpp's
// lookup example). The context is the full prompt followed by the tokens
// emitted so far. For n from max_n down to min_n, the context's last n
// tokens are looked up among the context's earlier n-grams (the suffix
// itself excluded; earlier occurrences may overlap it); at the most recent
// one, the up to k tokens that followed it are the proposal (fewer where
// the context ends). The first n that matches wins; no match proposes
// nothing. Copy-heavy outputs (quoting, editing, summarising the prompt)
// get long accepted runs; free text gets few.

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace specserve {

/// Defaults when neither prompt_lookup_min nor prompt_lookup_max is given.
/// vLLM's SpeculativeConfig sets both to 5 (untuned, it says); on our
/// copy-heavy evaluation (bench/results/ngram_drafting.md) n = 5 alone gave
/// 1.89 tokens per target forward and n = 2..5 gave 2.42, so we look down
/// to bigrams.
inline constexpr int kDefaultPromptLookupMin = 2;
inline constexpr int kDefaultPromptLookupMax = 5;
/// The largest n this server looks up (protos/router.proto).
inline constexpr int kMaxPromptLookup = 16;

/// The reference lookup over `context`, by a backwards scan (O(context *
/// max_n) per call; for tests and as the definition). Returns up to `k`
/// tokens, empty when nothing matches or k <= 0. Needs 1 <= min_n <= max_n.
std::vector<int> PromptLookupReference(absl::Span<const int> context,
                                       int min_n, int max_n, int k);

/// The same lookup over a growing context, with an index kept as tokens
/// arrive: for each n in [min_n, max_n], a hash map from an n-gram to the
/// end of its latest occurrence that is not the context's suffix. Append
/// costs O(max_n) hash-map updates per token and Propose O(max_n) lookups
/// (plus k copies), whatever the context's length; memory is O(context *
/// (max_n - min_n + 1)). The maps are keyed by a 64-bit hash of the n-gram
/// and every hit is checked token by token, so a hash collision can only
/// lose a match (never propose a wrong one). Not thread-safe.
class NgramProposer {
 public:
  /// Needs 1 <= min_n <= max_n <= kMaxPromptLookup (callers validate:
  /// router/request_options.h); out-of-range values are clamped into it.
  NgramProposer(int min_n, int max_n);

  /// Appends tokens to the context (the prompt, then each round's emitted
  /// tokens).
  void Append(absl::Span<const int> tokens);
  void Append(int token);

  /// The proposal for the current context: up to `k` tokens, equal to
  /// PromptLookupReference(context(), min_n, max_n, k) (bar the collision
  /// case above). Empty when nothing matches or k <= 0.
  std::vector<int> Propose(int k) const;

  /// Like Propose, and the n that matched (0 when none) in `*matched_n`.
  std::vector<int> Propose(int k, int* matched_n) const;

  const std::vector<int>& context() const { return tokens_; }
  int min_n() const { return min_n_; }
  int max_n() const { return max_n_; }

 private:
  // Hashes of the n-grams ending at `end` (exclusive), n = 1..max_n_, into
  // hashes[0..max_n_) (fewer when end < max_n_); returns how many.
  int SuffixHashes(int end, uint64_t* hashes) const;
  // Whether tokens_[a - n, a) == tokens_[b - n, b).
  bool SameNgram(int a, int b, int n) const;

  const int min_n_;
  const int max_n_;
  std::vector<int> tokens_;
  // index_[n - min_n_]: n-gram hash -> end (exclusive) of its latest
  // occurrence.
  // Every n-gram ending before the last token is indexed; the suffix is not.
  std::vector<absl::flat_hash_map<uint64_t, int>> index_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_NGRAM_PROPOSER_H_
