#ifndef SPECSERVE_BENCH_EVAL_UTIL_H_
#define SPECSERVE_BENCH_EVAL_UTIL_H_

// Building blocks of the fidelity evaluation (bench/eval_fidelity.cc): the
// baseline pruning methods, the target run on a pruned prompt at original
// positions, and the metrics that compare it with the full-prompt run.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/engine/model_runner.h"

namespace specserve {
namespace bench {

/// Random drop: index 0 (BOS), index n-1 (the last token) and count-2 other
/// indices drawn uniformly without replacement from [1, n-1) with `seed`.
/// Returns min(count, n) sorted unique indices in [0, n); count >= 2, n >= 1.
std::vector<int> KeepRandom(int n, int count, uint64_t seed);

/// Keep-most-recent: index 0 (BOS) plus the last count-1 indices.
/// Returns min(count, n) sorted unique indices.
std::vector<int> KeepRecent(int n, int count);

/// Attention sink + recent window (StreamingLLM-style): the first
/// min(sink, count-1) indices plus the most recent rest.
/// Returns min(count, n) sorted unique indices.
std::vector<int> KeepSinkRecent(int n, int count, int sink = 4);

/// The target's view of one (possibly pruned) prompt.
struct PrunedRun {
  std::vector<float> next_logits;  ///< [vocab] logits after the last token.
  std::vector<int> continuation;   ///< greedy tokens, EOS not special.
};

/// Prefills prompt[kept[i]] at RoPE position kept[i] (docs/ARCHITECTURE.md,
/// section 1 step 7), returns the last row's logits and `gen` greedy tokens
/// decoded at positions n, n+1, ... (n = prompt.size(), the ORIGINAL
/// length), continuing past EOS so every run yields `gen` tokens.
/// `kept`: sorted unique indices into `prompt`, ending at n-1.
/// Errors: INVALID_ARGUMENT for empty/unsorted `kept` or n + gen beyond the
/// target's context; the engine's errors otherwise.
absl::StatusOr<PrunedRun> RunPruned(ModelRunner& target,
                                    absl::Span<const int> prompt,
                                    absl::Span<const int> kept, int gen);

/// KL(softmax(p_logits) || softmax(q_logits)) in nats, computed in double
/// over the whole vocabulary (max-subtracted log-softmax). Sizes must match.
double KlDivergence(absl::Span<const float> p_logits,
                    absl::Span<const float> q_logits);

/// Position-wise match rate of two token sequences: matches over
/// max(a.size(), b.size()) positions (a missing token is a mismatch);
/// 1 when both are empty.
double MatchRate(absl::Span<const int> a, absl::Span<const int> b);

/// The text of a prompt file with trailing whitespace removed. NOT_FOUND
/// if it cannot be read.
absl::StatusOr<std::string> ReadPromptFile(const std::string& path);

/// All *.txt files under `dirs`, sorted by path within each directory
/// (a missing directory contributes none).
std::vector<std::string> PromptFiles(const std::vector<std::string>& dirs);

/// Mean and sample standard deviation (n-1; 0 for fewer than two values).
struct MeanStd {
  double mean = 0, std = 0;
};
MeanStd ComputeMeanStd(absl::Span<const double> xs);

}  // namespace bench
}  // namespace specserve

#endif  // SPECSERVE_BENCH_EVAL_UTIL_H_
