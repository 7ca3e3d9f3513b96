#ifndef SPECSERVE_COMMON_DECODING_LOGITS_PROCESSORS_H_
#define SPECSERVE_COMMON_DECODING_LOGITS_PROCESSORS_H_

// A request's logit adjustments before temperature / top-k / top-p, in
// the order vLLM's sampler applies them:
//   logit_bias (OpenAI): a fixed amount added to the listed ids' logits;
// then penalties on tokens the request has already seen (vLLM's
// apply_penalties):
//   repetition_penalty r, on every id in the prompt or the output
//     (Keskar et al. 2019, CTRL; HF's RepetitionPenaltyLogitsProcessor):
//     logit / r if the logit is > 0, logit * r otherwise;
//   frequency_penalty f and presence_penalty p, on output ids only
//     (OpenAI's definition): logit -= f * count + p * (count > 0).
// In that order. The output is what the target has emitted for the
// request; a speculative round's row j also counts the drafts before it,
// since it is the distribution the target would sample from had those
// drafts been emitted.

#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/types/span.h"
#include "common/decoding/sampling.h"

namespace specserve {

/// The ids a request's penalties read: the distinct prompt ids and how
/// often each id was emitted. One per request; not thread-safe.
class PenaltyTracker {
 public:
  /// prompt_ids: the whole prompt as the user sent it (a Speculative
  /// Prefill target gets the pruned-away ids too, so pruning does not
  /// change what is penalized). Negative ids are ignored.
  explicit PenaltyTracker(absl::Span<const int> prompt_ids);

  /// Counts `ids` as emitted (negative ids are ignored).
  void AddOutput(absl::Span<const int> ids);

  /// Applies `params`' penalties to one logit row ([vocab], in place): the
  /// row that follows the output so far and then `pending` (e.g. the
  /// drafts before this row in a verify forward), which count as output.
  /// Ids outside [0, vocab) are skipped. A no-op when
  /// !params.has_penalties(). Cost: O(distinct prompt + output ids).
  void Apply(const SamplingParams& params, absl::Span<const int> pending,
             absl::Span<float> logits) const;

  /// Emitted ids so far, counted (for tests).
  int output_count(int id) const;

 private:
  absl::flat_hash_set<int> prompt_;
  absl::flat_hash_map<int, int> output_;
};

/// Adds params.logit_bias to one logit row ([vocab], in place); ids
/// outside [0, vocab) are skipped.
void ApplyLogitBias(const SamplingParams& params, absl::Span<float> logits);

/// Applies one id's penalties to its logit (see the file comment):
/// `count` = times emitted (with pending), `in_prompt` = in the prompt.
float PenalizeLogit(float logit, int count, bool in_prompt,
                    const SamplingParams& params);

}  // namespace specserve

#endif  // SPECSERVE_COMMON_DECODING_LOGITS_PROCESSORS_H_
