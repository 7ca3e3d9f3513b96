#ifndef SPECSERVE_COMMON_SPECULATION_TARGET_SESSION_H_
#define SPECSERVE_COMMON_SPECULATION_TARGET_SESSION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/decoding/sampling.h"
#include "common/decoding/stop.h"
#include "common/decoding/verification.h"
#include "common/engine/model_runner.h"

namespace specserve {

/// A target request: the (possibly pruned) prompt with its original
/// positions, and how to generate.
struct TargetRequest {
  std::vector<int> token_ids;     ///< [n] kept prompt tokens.
  std::vector<int> position_ids;  ///< [n] strictly increasing, original.
  /// Original prompt length: generated token i sits at next_position + i,
  /// never at n + i (docs REFERENCE.md section 1, step 7). -1 = last
  /// position + 1.
  int next_position = -1;
  SamplingParams sampling;
  /// max_new_tokens and stop ids; EOS ids and the context limit are taken
  /// from the model config by Create (unless ignore_eos).
  StopConditions stop;
  bool ignore_eos = false;
  int max_drafts = 64;  ///< drafts accepted per round at most.
};

/// One round: the prefill (with optional drafts) or one verification.
struct RoundResult {
  int num_drafts = 0;    ///< drafts verified (after clipping to budgets).
  int num_accepted = 0;  ///< of those, accepted.
  std::vector<int> tokens;  ///< emitted this round (after stop handling).
  FinishReason finish = FinishReason::kNone;
  int64_t forward_ns = 0;   ///< the round's forward + verification.
};

/// The target's per-request state: prefill of the kept tokens at their
/// original positions, then rounds that verify drafts in ONE forward over
/// [last emitted token, x_1..x_k] (Leviathan et al. 2023; greedy or lossless
/// rejection sampling, docs REFERENCE.md section 2) and roll the KV cache
/// back to the accepted length. k = 0 is a plain decode step; the first
/// round verifies its drafts in the prefill forward.
class TargetSession {
 public:
  /// Validates the request: INVALID_ARGUMENT naming the field for an empty
  /// prompt, length mismatch, ids outside the vocabulary, positions not
  /// strictly increasing or at/after the max context, next_position <= the
  /// last position or >= max context, bad sampling or stop conditions,
  /// max_new_tokens < 1.
  static absl::StatusOr<std::unique_ptr<TargetSession>> Create(
      ModelRunner* model, TargetRequest request);

  /// Runs the next round with `drafts` (validated: ids in the vocabulary,
  /// well-formed q when sampling; at most max_drafts). Drafts past the
  /// token budget or context are dropped. FAILED_PRECONDITION once
  /// finished.
  absl::StatusOr<RoundResult> Step(absl::Span<const DraftToken> drafts);

  bool finished() const { return stop_.finished(); }
  FinishReason finish_reason() const { return stop_.reason(); }
  /// Every token emitted so far.
  const std::vector<int>& output() const { return output_; }
  /// Bytes of KV cache in use / reserved for this request.
  size_t kv_bytes() const { return cache_->bytes_used(); }
  /// Tokens in the KV cache.
  int kv_tokens() const { return cache_->size(); }
  size_t kv_capacity_bytes() const { return cache_->bytes_capacity(); }
  /// Tokens the KV cache may need: kept + max_new_tokens + max_drafts.
  static int CapacityFor(const ModelConfig& config, const TargetRequest& r);

 private:
  TargetSession(ModelRunner* model, TargetRequest request,
                std::unique_ptr<KvSequence> cache);

  ModelRunner* model_;
  TargetRequest request_;
  std::unique_ptr<KvSequence> cache_;  // this request's blocks in the model's paged cache
  StopChecker stop_;
  Rng rng_;
  bool prefilled_ = false;
  std::vector<int> output_;
};

}  // namespace specserve

#endif  // SPECSERVE_COMMON_SPECULATION_TARGET_SESSION_H_
