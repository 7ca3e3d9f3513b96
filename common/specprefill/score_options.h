#ifndef SPECSERVE_COMMON_SPECPREFILL_SCORE_OPTIONS_H_
#define SPECSERVE_COMMON_SPECPREFILL_SCORE_OPTIONS_H_

// The options of one Speculative Prefill scoring call (Liu, Chen, Zhang,
// ICML 2025): the look-ahead, the importance scoring and the chunk
// selection. Model-free: the router validates requests with it without
// linking the engine.

#include "absl/status/status.h"
#include "common/specprefill/importance.h"
#include "common/specprefill/selection.h"

namespace specserve {

/// Everything one Speculative Prefill scoring call needs (official defaults:
/// look-ahead 8, pool 13, chunk 32, keep 0.3; docs/ARCHITECTURE.md). These
/// member initializers are the one place the defaults are written: the
/// services' and the router's --default_* flags start from them.
struct ScoreOptions {
  int look_ahead = 8;   ///< greedy look-ahead tokens, [0, 64].
  int num_threads = 1;  ///< threads for the importance reduction.
  ScoringOptions scoring;
  SelectionOptions selection;
};

/// INVALID_ARGUMENT naming the field for out-of-range options.
absl::Status ValidateScoreOptions(const ScoreOptions& options, int num_layers);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SPECPREFILL_SCORE_OPTIONS_H_
