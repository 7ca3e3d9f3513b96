#ifndef SPECSERVE_COMMON_SPECPREFILL_SELECTION_H_
#define SPECSERVE_COMMON_SPECPREFILL_SELECTION_H_

// Token selection of Speculative Prefill (Liu, Chen, Zhang, ICML 2025,
// arXiv 2502.02789, sections 3.2.3 and 3.2.4; docs/ARCHITECTURE.md, Speculative Prefill
// steps 6-7): keep the top chunks of the prompt by mean importance, and give
// every kept token its ORIGINAL position.

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace specserve {

/// Knobs of the selection step. Official defaults: keep 0.1 .. 0.9 (0.3
/// common), chunk_size 32. The official code forces nothing in; keep_first /
/// keep_last (BOS attention sink, and the token the next-token logits come
/// from) follow the llama.cpp port and the worked example.
struct SelectionOptions {
  float keep_ratio = 0.3f;    ///< fraction of chunks kept, in (0, 1].
  int chunk_size = 32;        ///< >= 1; 1 = token-level selection.
  int keep_first = 1;         ///< always keep the first k prompt tokens.
  int keep_last = 1;          ///< always keep the last k prompt tokens.
  int min_prompt_tokens = 0;  ///< prompts shorter than this are not pruned.
  /// Keep by importance mass, in [0, 1]; 0 = off. When set, the fewest
  /// top-ranked chunks whose summed importance reaches keep_mass of the
  /// prompt's total are kept, at most keep_ratio's count (keep_ratio is the
  /// ceiling): the paper's "query compressibility" (section 5) turned into
  /// a per-prompt budget, so peaked importance keeps less.
  float keep_mass = 0.0f;
};

/// OK, or INVALID_ARGUMENT naming the field: keep_ratio not in (0, 1]
/// (NaN included), keep_mass not in [0, 1] (NaN included), chunk_size < 1, keep_first < 0, keep_last < 0,
/// min_prompt_tokens < 0.
absl::Status ValidateSelectionOptions(const SelectionOptions& opts);

/// The result of SelectTokens for a prompt of n tokens.
struct Selection {
  /// Prompt indices to feed the target, sorted ascending, unique.
  std::vector<int> kept_indices;
  /// RoPE positions of the kept tokens: their original indices
  /// (== kept_indices; docs/ARCHITECTURE.md, step 7).
  std::vector<int> position_ids;
  /// Position of the first decoded token: the ORIGINAL prompt length n,
  /// not kept_indices.size().
  int next_position = 0;
  /// [ceil(n / chunk_size)] mean importance of each chunk.
  std::vector<float> chunk_scores;
  /// Chunks chosen by score, sorted ascending. Chunks that only contribute
  /// forced tokens (keep_first / keep_last) are not listed. All chunks when
  /// nothing is pruned.
  std::vector<int> kept_chunks;
};

/// Number of chunks kept out of `num_chunks` at `keep_ratio`:
/// ceil(num_chunks * keep_ratio), clamped to [1, num_chunks].
/// The product is taken in double and shrunk by a relative 1e-6 before the
/// ceil, because a float ratio is not the decimal the user wrote: 0.3f is
/// 0.300000012, so 10 * 0.3f would otherwise round up to 4 chunks instead
/// of 3 (golden specprefill_case1). 1e-6 is far above float's 6e-8 relative
/// representation error and far below any intended fractional part.
int NumChunksToKeep(int num_chunks, float keep_ratio);

/// Selects the prompt tokens to keep from per-token `importance` [n].
/// Chunks: ceil(n / chunk_size) contiguous chunks (the last may be short),
/// chunk score = mean of its tokens' scores (computed in double); the top
/// NumChunksToKeep chunks are kept, ties broken by higher score first, then
/// lower chunk index. With keep_mass > 0 the count is instead the fewest
/// chunks of that ranking whose summed token importance (negative scores
/// count as 0) reaches keep_mass * the total, capped at NumChunksToKeep;
/// a prompt with zero total importance keeps one chunk. The first keep_first and last keep_last tokens are
/// added ON TOP of the chosen chunks (union). If n < min_prompt_tokens or
/// keep_ratio == 1 without keep_mass, every token is kept.
/// Errors: INVALID_ARGUMENT for invalid options (see
/// ValidateSelectionOptions), an empty `importance`, or a non-finite
/// score (named by index).
absl::StatusOr<Selection> SelectTokens(absl::Span<const float> importance,
                                       const SelectionOptions& opts);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SPECPREFILL_SELECTION_H_
