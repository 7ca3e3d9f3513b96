#ifndef SPECSERVE_COMMON_DECODING_LOGPROBS_H_
#define SPECSERVE_COMMON_DECODING_LOGPROBS_H_

// Log-probabilities of emitted tokens (OpenAI's `logprobs`), as vLLM v1
// computes them by default (logprobs_mode = raw_logprobs): the log-softmax
// of the model's RAW logits at the position that produced the token, before
// temperature, top-k / top-p or penalties.

#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace specserve {

/// The most top alternatives a request may ask for (OpenAI's and vLLM's
/// default max_logprobs: 20).
inline constexpr int kMaxTopLogprobs = 20;

/// One emitted token's log-probability and the likeliest alternatives.
struct TokenLogprobs {
  float logprob = 0.f;  ///< log p(token), natural log, <= 0.
  /// The top_n likeliest ids with their log-probabilities, descending; ties
  /// go to the lower id. May or may not contain the token itself.
  std::vector<std::pair<int, float>> top;
};

/// log_softmax(logits)[token] and the top `top_n` (id, logprob) pairs of
/// one raw logit row [vocab], computed in double on the host (max-shifted
/// log-sum-exp). NaN logits count as -inf (never in the top); a row of
/// only -inf / NaN gives -inf everywhere. top_n is clamped to [0, vocab];
/// token must be in [0, vocab).
TokenLogprobs ComputeTokenLogprobs(absl::Span<const float> logits, int token,
                                   int top_n);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_LOGPROBS_H_
